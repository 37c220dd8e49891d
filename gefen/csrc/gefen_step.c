/*
 * Fused Gefen step on CPU (docs/design.md 3.1 "Step"), bit-identical to the eager reference in
 * gefen/functional.py (second_moment_partials + gefen_update_).
 *
 * Plain C99 + optional OpenMP, no Python C-API and no torch headers: gefen.native loads this
 * shared object with ctypes (same pattern as kmeans_dp.c).  Built by setup.py as
 * gefen._gefen_step; without OpenMP it still builds and runs single-threaded.
 *
 * Why the code looks the way it does: "identical state" means reproducing every fp32
 * rounding of the eager torch ops, in the same order:
 *   - elementwise ops are emulated one rounding at a time; torch's CPU kernels use a fused
 *     multiply-add for lerp (fma(w, end - self, self)) and for add(..., alpha)
 *     (fma(other, alpha, self)), so we call fmaf() there and nowhere else (the file must be
 *     compiled with -ffp-contract=off so that the compiler adds no other contraction);
 *   - sums (block mean of g^2, row means of g^2, float64 column sums, the float64 sum of
 *     v_row) reproduce ATen's cascade_sum (aten/src/ATen/native/cpu/SumKernel.cpp): the
 *     4-level chunked accumulation, its 4-way ILP, its vector width W (8 floats on AVX2 and
 *     the default build, 16 on AVX512), the contiguous-outer column grouping, and how
 *     TensorIterator::parallel_reduce splits work over `T` torch threads (two-pass reductions
 *     for single outputs, 128-byte-rounded column ranges).  gefen.native checks this against
 *     torch at first use and falls back to eager when it does not match;
 *   - the nearest code is the count of fp32 thresholds (gefen.codebook.code_thresholds)
 *     strictly below x, NaN -> last code, i.e. torch.searchsorted(right=False).  It is found
 *     with a uniform bucket LUT whose buckets hold <= 2 thresholds (exact: the bucket map is
 *     monotone, see gefen_build_lut), or by binary search when no LUT fits;
 *   - torch's CPU sqrt is MKL's vmsSqrt (not correctly rounded): gefen.native passes us its
 *     address with every call (gefen_mode in gefen_common.h).
 * Work is split over blocks / rows / 256-row chunks with OpenMP; any split gives the same result
 * because each output is computed by exactly one thread in a fixed order.  Table lookups stay
 * scalar (AVX2 gathers measured slower); the arithmetic is AVX2 when the CPU has it and the
 * call's mode allows it, with a portable twin that produces identical bits.
 *
 * Memory traffic of one step: param read + write, grad read (twice for factored tensors:
 * phase 1 reads it for the row/column statistics), codes read + write, per-block state.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gefen_common.h"

#define GEFEN_ABI 17
#define GRAIN 32768   /* at::internal::GRAIN_SIZE */
#define PAR_MIN 32768 /* below this many elements a tensor is processed by one thread */
#define MAX_T 1024    /* largest torch thread count we emulate */

/* ----- scalar helpers ------------------------------------------------------------------- */

static inline float bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline int64_t divup(int64_t a, int64_t b) { return (a + b - 1) / b; }
static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* utils::CeilLog2 and multi_row_sum's level power. */
static inline int64_t ceil_log2(int64_t x) {
    if (x <= 2) return 1;
    return 64 - __builtin_clzll((unsigned long long)(x - 1));
}
static inline int level_power(int64_t size) {
    int64_t c = ceil_log2(size) / 4;
    return c > 4 ? (int)c : 4;
}

/* ----- ATen cascade_sum, reproduced ------------------------------------------------------
 * For each element type LOAD(x, i) (the i-th summand, e.g. g[i]^2 in fp32), sum_X_w(x, off,
 * stride, n, W) is
 *   W == 1: row_sum<acc_t, ScalarLoadPolicy> (4-way ILP over n elements `stride` apart, each a
 *       4-level cascade), used for short rows and "B"-order columns;
 *   W > 1: vectorized_inner_sum over a contiguous run of n >= W elements (stride 1): row_sum
 *       over W-lane vectors, then the scalar tail, then the lanes;
 * and inner_X(x, off, n, W) picks between them for a contiguous run, as torch does.  (For W == 1
 * the closing `0 + acc` is row_sum's plain result: acc starts at +0, so it is never -0.)
 * A result is stored by torch as `out(=0) += value`, hence the `0 +` at the call sites.
 */
#define LD_SQ_F32(x, i) (((const float *)(x))[i] * ((const float *)(x))[i])
#define LD_SQ_BF16(x, i) (bf16_to_f32(((const uint16_t *)(x))[i]) * bf16_to_f32(((const uint16_t *)(x))[i]))
#define LD_SQD_F32(x, i) ((double)LD_SQ_F32(x, i))
#define LD_SQD_BF16(x, i) ((double)LD_SQ_BF16(x, i))
#define LD_F32(x, i) (((const float *)(x))[i])
#define LD_D_F32(x, i) ((double)((const float *)(x))[i])
#define LD_F64(x, i) (((const double *)(x))[i])

#define DEF_SUMS(SUF, ACC, LOAD)                                                                \
    static inline __attribute__((always_inline)) ACC sum_##SUF##_w(                              \
        const void *x, int64_t off, int64_t stride, int64_t n, const int W) {                   \
        const int L = 4 * W;                                                                    \
        const int64_t vs = n / W, sz = vs / 4;                                                  \
        const int lp = level_power(sz);                                                         \
        const int64_t step = (int64_t)1 << lp, mask = step - 1;                                 \
        ACC acc[4][64];                                                                         \
        for (int lv = 0; lv < 4; ++lv)                                                          \
            for (int e = 0; e < L; ++e) acc[lv][e] = 0;                                         \
        int64_t i = 0;                                                                          \
        while (i + step <= sz) {                                                                \
            for (int64_t j = 0; j < step; ++j, ++i)                                             \
                for (int e = 0; e < L; ++e) acc[0][e] += LOAD(x, off + (i * L + e) * stride);   \
            for (int lv = 1; lv < 4; ++lv) {                                                    \
                for (int e = 0; e < L; ++e) {                                                   \
                    acc[lv][e] += acc[lv - 1][e];                                               \
                    acc[lv - 1][e] = 0;                                                         \
                }                                                                               \
                if (i & (mask << (lv * lp))) break;                                             \
            }                                                                                   \
        }                                                                                       \
        for (; i < sz; ++i)                                                                     \
            for (int e = 0; e < L; ++e) acc[0][e] += LOAD(x, off + (i * L + e) * stride);       \
        for (int lv = 1; lv < 4; ++lv)                                                          \
            for (int e = 0; e < L; ++e) acc[0][e] += acc[lv][e];                                \
        for (int64_t v = sz * 4; v < vs; ++v)                                                   \
            for (int l = 0; l < W; ++l) acc[0][l] += LOAD(x, off + (v * W + l) * stride);       \
        for (int k = 1; k < 4; ++k)                                                             \
            for (int l = 0; l < W; ++l) acc[0][l] += acc[0][k * W + l];                         \
        ACC fin = 0;                                                                            \
        for (int64_t e = vs * W; e < n; ++e) fin += LOAD(x, off + e * stride);                  \
        for (int l = 0; l < W; ++l) fin += acc[0][l];                                           \
        return fin;                                                                             \
    }                                                                                           \
    static ACC inner_##SUF(const void *x, int64_t off, int64_t n, int W) {                      \
        switch (n < W ? 1 : W) {                                                                \
        case 1: return sum_##SUF##_w(x, off, 1, n, 1);                                          \
        case 4: return sum_##SUF##_w(x, off, 1, n, 4);                                          \
        case 8: return sum_##SUF##_w(x, off, 1, n, 8);                                          \
        default: return sum_##SUF##_w(x, off, 1, n, 16);                                        \
        }                                                                                       \
    }

DEF_SUMS(sq_f32, float, LD_SQ_F32)
DEF_SUMS(sq_bf16, float, LD_SQ_BF16)
DEF_SUMS(sqd_f32, double, LD_SQD_F32)
DEF_SUMS(sqd_bf16, double, LD_SQD_BF16)
DEF_SUMS(f32, float, LD_F32)
DEF_SUMS(d_f32, double, LD_D_F32)
DEF_SUMS(f64, double, LD_F64)

#if GEFEN_X86
/* ----- AVX2 + FMA helpers (the same roundings, 8 lanes at a time) -------------------------- */
#define CLONES __attribute__((target_clones("avx2", "default")))

/* inner_sq_*_w(.., 8) with 8-lane registers: one multi_row_sum cascade over quads of vectors. */
static AVX2 float inner_sq_avx2(const void *g, int dt, int64_t off, int64_t n) {
    if (n < 8) return dt == DT_F32 ? inner_sq_f32(g, off, n, 8) : inner_sq_bf16(g, off, n, 8); /* row_sum */
    const int64_t vs = n / 8, sz = vs / 4;
    const int lp = level_power(sz);
    const int64_t step = (int64_t)1 << lp, mask = step - 1;
    const __m256 z = _mm256_setzero_ps();
    __m256 a0[4] = {z, z, z, z}, a1[4] = {z, z, z, z}, a2[4] = {z, z, z, z}, a3[4] = {z, z, z, z};
    int64_t i = 0;
    while (i + step <= sz) {
        for (int64_t j = 0; j < step; ++j, ++i) {
            const int64_t base = off + i * 32;
            for (int k = 0; k < 4; ++k) {
                __m256 x = ld8_g(g, dt, base + 8 * k);
                a0[k] = _mm256_add_ps(a0[k], _mm256_mul_ps(x, x));
            }
        }
        for (int k = 0; k < 4; ++k) {
            a1[k] = _mm256_add_ps(a1[k], a0[k]);
            a0[k] = z;
        }
        if (i & (mask << lp)) continue;
        for (int k = 0; k < 4; ++k) {
            a2[k] = _mm256_add_ps(a2[k], a1[k]);
            a1[k] = z;
        }
        if (i & (mask << (2 * lp))) continue;
        for (int k = 0; k < 4; ++k) {
            a3[k] = _mm256_add_ps(a3[k], a2[k]);
            a2[k] = z;
        }
    }
    for (; i < sz; ++i) {
        const int64_t base = off + i * 32;
        for (int k = 0; k < 4; ++k) {
            __m256 x = ld8_g(g, dt, base + 8 * k);
            a0[k] = _mm256_add_ps(a0[k], _mm256_mul_ps(x, x));
        }
    }
    for (int k = 0; k < 4; ++k) a0[k] = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0[k], a1[k]), a2[k]), a3[k]);
    for (int64_t v = sz * 4; v < vs; ++v) {
        __m256 x = ld8_g(g, dt, off + v * 8);
        a0[0] = _mm256_add_ps(a0[0], _mm256_mul_ps(x, x));
    }
    a0[0] = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0[0], a0[1]), a0[2]), a0[3]);
    float lanes[8], fin = 0.0f;
    _mm256_storeu_ps(lanes, a0[0]);
    for (int64_t e = vs * 8; e < n; ++e) {
        float x = ld_g(g, dt, off + e);
        fin += x * x;
    }
    for (int l = 0; l < 8; ++l) fin += lanes[l];
    return fin;
}
#else
#define CLONES
#endif

/* sum of g[off .. off+n)^2 over one contiguous run, as vectorized_inner_sum computes it */
static inline float inner_sq(const void *g, int dt, int64_t off, int64_t n, int W, int avx2) {
#if GEFEN_X86
    if (W == 8 && avx2) return inner_sq_avx2(g, dt, off, n);
#endif
    (void)avx2;
    return dt == DT_F32 ? inner_sq_f32(g, off, n, W) : inner_sq_bf16(g, off, n, W);
}

/* the same in float64 ((double)(g^2) summed), and row_sum's strided form of it */
static inline double inner_sqd(const void *g, int dt, int64_t off, int64_t n, int Wd) {
    return dt == DT_F32 ? inner_sqd_f32(g, off, n, Wd) : inner_sqd_bf16(g, off, n, Wd);
}
static inline double rowsum_sqd(const void *g, int dt, int64_t off, int64_t stride, int64_t n) {
    return dt == DT_F32 ? sum_sqd_f32_w(g, off, stride, n, 1) : sum_sqd_bf16_w(g, off, stride, n, 1);
}

/* TensorIterator::parallel_reduce's two-pass strategy for a reduction with one output: n >= GRAIN
 * summands and T > 1 torch threads are summed in chunks of the returned length (0: one pass), one
 * partial per thread, then the T partials are summed.  The three sums below follow it. */
static int64_t two_pass_chunk(int64_t n, int T) {
    return n < GRAIN || T <= 1 ? 0 : divup(n, min64(T, divup(n, GRAIN)));
}

/* fp32 sum of g[off .. off+n)^2 as torch sums it; `single` = the reduction has one output. */
static float tsum_sq(const void *g, int dt, int64_t off, int64_t n, int W, int T, int single, int avx2) {
    const int64_t chunk = single ? two_pass_chunk(n, T) : 0;
    if (!chunk) return 0.0f + inner_sq(g, dt, off, n, W, avx2);
    float buf[MAX_T] = {0};
    for (int64_t b = 0, t = 0; b < n; b += chunk, ++t)
        buf[t] = 0.0f + inner_sq(g, dt, off + b, min64(chunk, n - b), W, avx2);
    return 0.0f + inner_f32(buf, 0, T, W);
}

/* float64 sum of (double)x[i] over a float array (v_row.sum(dtype=float64)), one output. */
static double tsum_d_f32(const float *x, int64_t n, int Wd, int T) {
    const int64_t chunk = two_pass_chunk(n, T);
    if (!chunk) return 0.0 + inner_d_f32(x, 0, n, Wd);
    double buf[MAX_T] = {0};
    for (int64_t b = 0, t = 0; b < n; b += chunk, ++t) buf[t] = 0.0 + inner_d_f32(x, b, min64(chunk, n - b), Wd);
    return 0.0 + inner_f64(buf, 0, T, Wd);
}

/* float64 sum of (double)(g^2) over a contiguous run, one output (column sums when cols == 1). */
static double tsum_sqd(const void *g, int dt, int64_t n, int Wd, int T) {
    const int64_t chunk = two_pass_chunk(n, T);
    if (!chunk) return 0.0 + inner_sqd(g, dt, 0, n, Wd);
    double buf[MAX_T] = {0};
    for (int64_t b = 0, t = 0; b < n; b += chunk, ++t) buf[t] = 0.0 + inner_sqd(g, dt, b, min64(chunk, n - b), Wd);
    return 0.0 + inner_f64(buf, 0, T, Wd);
}

/* ----- column sums: sq.sum(0, dtype=float64) of a [rows, cols] matrix --------------------
 * cascade_sum's contiguous-outer path sums, per thread range of columns, the first columns in
 * groups of 4 vectors with multi_row_sum ("A": one cascade down the rows per column) and the
 * remaining < 4 vectors' worth of columns with row_sum ("B": 4-way ILP down the rows).
 */
static int col_ranges(int64_t rows, int64_t cols, int T, int64_t *rb, int64_t *re) {
    if (rows * cols < GRAIN || T <= 1) {
        rb[0] = 0;
        re[0] = cols;
        return 1;
    }
    /* parallel_dim_reduction: at::parallel_for(0, cols, 1) then round to 128 bytes (16 doubles) */
    int64_t nt = min64(T, cols), chunk = divup(cols, nt);
    int n = 0;
    for (int64_t t = 0; t < nt; ++t) {
        int64_t b = t * chunk;
        if (b >= cols) break;
        int64_t e = min64(cols, b + chunk);
        b = min64((b + 15) / 16 * 16, cols);
        e = min64((e + 15) / 16 * 16, cols);
        if (b == e) continue;
        rb[n] = b;
        re[n] = e;
        ++n;
    }
    return n;
}

static int64_t a_columns(int64_t n, int Wd) {
    return n >= Wd ? n / (4 * Wd) * (4 * Wd) : n / 4 * 4;
}

/* acc[c] += (double)(g[off + c]^2), c < n */
static CLONES void add_sq_row(double *acc, const void *g, int dt, int64_t off, int64_t n) {
    if (dt == DT_F32) {
        const float *src = (const float *)g + off;
        for (int64_t c = 0; c < n; ++c) acc[c] += (double)(src[c] * src[c]);
    } else {
        const uint16_t *src = (const uint16_t *)g + off;
        for (int64_t c = 0; c < n; ++c) {
            float v = bf16_to_f32(src[c]);
            acc[c] += (double)(v * v);
        }
    }
}

/* one cascade level into the next: hi += lo, lo = 0 */
static CLONES void flush_into(double *hi, double *lo, int64_t n) {
    for (int64_t c = 0; c < n; ++c) {
        hi[c] += lo[c];
        lo[c] = 0.0;
    }
}

/* "A" order for columns [c0, c1): acc holds 4 levels x (c1 - c0) doubles. */
static CLONES void colsum_A(const void *g, int dt, int64_t rows, int64_t cols, int64_t c0, int64_t c1,
                     double *acc, double *out) {
    const int64_t nc = c1 - c0;
    double *a0 = acc, *lvl[4] = {acc, acc + nc, acc + 2 * nc, acc + 3 * nc};
    memset(acc, 0, (size_t)(4 * nc) * sizeof(double));
    const int lp = level_power(rows);
    const int64_t step = (int64_t)1 << lp, mask = step - 1;
    int64_t i = 0;
    while (i + step <= rows) {
        for (int64_t j = 0; j < step; ++j, ++i) add_sq_row(a0, g, dt, i * cols + c0, nc);
        for (int lv = 1; lv < 4; ++lv) {
            flush_into(lvl[lv], lvl[lv - 1], nc);
            if (i & (mask << (lv * lp))) break;
        }
    }
    for (; i < rows; ++i) add_sq_row(a0, g, dt, i * cols + c0, nc);
    for (int lv = 1; lv < 4; ++lv)
        for (int64_t c = 0; c < nc; ++c) a0[c] += lvl[lv][c];
    for (int64_t c = 0; c < nc; ++c) out[c0 + c] = 0.0 + a0[c];
}

static void column_sums(const void *g, int dt, int64_t rows, int64_t cols, int Wd, int T, double *out,
                        int nthreads) {
    if (cols == 1) {
        out[0] = tsum_sqd(g, dt, rows, Wd, T);
        return;
    }
    int64_t rb[MAX_T], re[MAX_T];
    int nr = col_ranges(rows, cols, T, rb, re);
    /* B columns: few (< 4 vectors per torch range), strided, serial */
    for (int r = 0; r < nr; ++r) {
        for (int64_t j = rb[r] + a_columns(re[r] - rb[r], Wd); j < re[r]; ++j)
            out[j] = 0.0 + rowsum_sqd(g, dt, j, cols, rows);
    }
    /* A columns: split into pieces of <= `piece` columns, pieces spread over threads */
    int64_t piece = cols / (nthreads > 0 ? nthreads : 1);
    piece = (piece + 15) / 16 * 16;
    if (piece > 1024) piece = 1024;
    if (piece < 16) piece = 16;
    int64_t npieces = 0;
    for (int r = 0; r < nr; ++r) npieces += divup(a_columns(re[r] - rb[r], Wd), piece);
    int par = rows * cols >= PAR_MIN && nthreads > 1;
    (void)par;
#pragma omp parallel if (par)
    {
        double *acc = (double *)malloc((size_t)(4 * piece) * sizeof(double));
        int64_t k = 0;
#pragma omp for schedule(static)
        for (k = 0; k < npieces; ++k) {
            /* locate piece k */
            int64_t kk = k;
            for (int r = 0; r < nr; ++r) {
                int64_t na = a_columns(re[r] - rb[r], Wd), np = divup(na, piece);
                if (kk < np) {
                    int64_t c0 = rb[r] + kk * piece, c1 = min64(c0 + piece, rb[r] + na);
                    if (acc) {
                        colsum_A(g, dt, rows, cols, c0, c1, acc, out);
                    } else { /* out of memory: per-column, same order, no buffer */
                        for (int64_t c = c0; c < c1; ++c) {
                            double one[4];
                            colsum_A(g, dt, rows, cols, c, c + 1, one, out);
                        }
                    }
                    break;
                }
                kk -= np;
            }
        }
        free(acc);
    }
}

/* ----- phase 1: second_moment_partials (m8) -------------------------------------------------
 * v_row_new = v_row * b2 + mean_cols(g^2) * (1 - b2)          (fp32, two products and a sum)
 * partials  = [sum_rows(g^2) as float64..., sum(v_row_new) as float64]
 */
/* Row r's mean of g^2 as the reference forms it: sq.mean(1) (an fp32 sum / cols). */
static float row_mean_sq(const void *g, int dt, int64_t r, int64_t cols, int W, int T, int single, int avx2) {
    return tsum_sq(g, dt, r * cols, cols, W, T, single, avx2) / (float)cols;
}

/* ----- phase 1 in one pass --------------------------------------------------------------------
 * Column sums in "A" order are one cascade down all rows per column: level-1 chunks of S rows,
 * level-2 chunks of S^2 rows, ... (S = 2^level_power(rows)).  A thread that owns whole level-2
 * chunks computes their sums exactly as the sequential cascade would (both levels start from 0
 * at a chunk boundary), and so can also compute the row sums of the rows it streams.  The
 * levels above are then combined per column, in order, by combine_chunks. */
typedef struct {
    const void *g;
    int dt, W, T;
    int64_t rows, cols, S, S2, nfull;
    const float *v_row_old;
    float *v_row_new;
    float b2, o2;
    int avx2; /* AVX2 allowed */
    double *c2;   /* [nfull][cols]: level-2 chunk sums */
    double *tail; /* [2][cols]: the last, partial chunk's level-1 sum and trailing rows */
} p1ctx;

/* Level-2 chunks [k0, k1) (the partial last chunk is index nfull); acc: 2 * cols doubles. */
static void phase1_chunks(const p1ctx *x, int64_t k0, int64_t k1, double *acc) {
    const int64_t cols = x->cols;
    double *a0 = acc, *a1 = acc + cols;
    for (int64_t k = k0; k < k1; ++k) {
        const int64_t r0 = k * x->S2, r1 = min64(r0 + x->S2, x->rows);
        memset(acc, 0, (size_t)(2 * cols) * sizeof(double));
        int64_t in_chunk1 = 0;
        for (int64_t r = r0; r < r1; ++r) {
            float mean = row_mean_sq(x->g, x->dt, r, cols, x->W, x->T, 0, x->avx2);
            x->v_row_new[r] = x->v_row_old[r] * x->b2 + mean * x->o2;
            add_sq_row(a0, x->g, x->dt, r * cols, cols);
            if (++in_chunk1 == x->S) {
                flush_into(a1, a0, cols);
                in_chunk1 = 0;
            }
        }
        if (k < x->nfull) {
            memcpy(x->c2 + k * cols, a1, (size_t)cols * sizeof(double));
        } else {
            memcpy(x->tail, a1, (size_t)cols * sizeof(double));
            memcpy(x->tail + cols, a0, (size_t)cols * sizeof(double));
        }
    }
}

/* The levels above 2, per column, in multi_row_sum's order: out = 0 + (((a0 + a1) + a2) + a3). */
static void combine_chunks(const p1ctx *x, int lp, int has_tail, int64_t c0, int64_t c1, double *out) {
    const int64_t cols = x->cols, mask = x->S - 1;
    for (int64_t c = c0; c < c1; ++c) {
        double a2 = 0.0, a3 = 0.0;
        for (int64_t k = 0; k < x->nfull; ++k) {
            a2 += x->c2[k * cols + c];
            const int64_t i = (k + 1) * x->S2;
            if (!(i & (mask << (2 * lp)))) {
                a3 += a2;
                a2 = 0.0;
            }
        }
        double a0 = has_tail ? x->tail[cols + c] : 0.0, a1 = has_tail ? x->tail[c] : 0.0;
        out[c] = 0.0 + (((a0 + a1) + a2) + a3);
    }
}

/* Returns 0, or -1 when it does not apply / is out of memory (then nothing useful was written). */
static int phase1_one_pass(const void *grad, int dt, int64_t rows, int64_t cols, const float *v_row_old,
                           float *v_row_new, double *partials, float b2, float o2, int W, int T, int nthreads,
                           int avx2) {
    const int lp = level_power(rows);
    const int64_t S = (int64_t)1 << lp, S2 = S * S;
    const int64_t nfull = rows / S2, nchunks = divup(rows, S2);
    if (cols < 2 || nchunks < nthreads || (rows == 1 && cols >= GRAIN && T > 1)) return -1;
    p1ctx x = {grad, dt, W, T, rows, cols, S, S2, nfull, v_row_old, v_row_new, b2, o2, avx2, NULL, NULL};
    x.c2 = (double *)malloc((size_t)(nfull * cols + 2 * cols) * sizeof(double));
    double *accs = (double *)malloc((size_t)nthreads * (size_t)(2 * cols) * sizeof(double));
    if (!x.c2 || !accs) {
        free(x.c2);
        free(accs);
        return -1;
    }
    x.tail = x.c2 + nfull * cols;
    const int has_tail = nchunks > nfull;
#pragma omp parallel
    {
        int64_t k0, k1, c0, c1;
        thread_range(nchunks, &k0, &k1);
        phase1_chunks(&x, k0, k1, accs + (size_t)thread_id() * (size_t)(2 * cols));
#pragma omp barrier
        thread_range(cols, &c0, &c1);
        combine_chunks(&x, lp, has_tail, c0, c1, partials);
    }
    free(x.c2);
    free(accs);
    /* columns that torch sums in "B" order (< 4 vectors per torch column range): redo them */
    int64_t rb[MAX_T], re[MAX_T];
    const int Wd = W / 2, nr = col_ranges(rows, cols, T, rb, re);
    for (int r = 0; r < nr; ++r)
        for (int64_t j = rb[r] + a_columns(re[r] - rb[r], Wd); j < re[r]; ++j)
            partials[j] = 0.0 + rowsum_sqd(grad, dt, j, cols, rows);
    return 0;
}

/* Phase 1 of the m8 layout (second_moment_partials; m4v4_step.c has the m4v4 layout's):
 *   v_row_new = v_row * b2 + (sum_cols(g^2) / cols) * (1 - b2)
 *   partials  = [sum_rows(g^2) as float64..., sum(v_row_new)]
 * The mode only chooses the kernels (isa). */
GEFEN_EXPORT int gefen_partials(const void *grad, int32_t gdt, int64_t rows, int64_t cols, const float *v_row_old,
                                float *v_row_new, double *partials, double beta2, double omb2, int32_t W, int32_t T,
                                const gefen_mode *mode) {
    if (T < 1 || T > MAX_T || (W != 8 && W != 16) || cols < 1 || rows < 0 || !mode) return -2;
    const float b2 = (float)beta2, o2 = (float)omb2;
    const int single = rows == 1, nthreads = max_threads(), avx2 = call_isa(mode) >= 1;
    if (rows * cols < PAR_MIN || phase1_one_pass(grad, gdt, rows, cols, v_row_old, v_row_new, partials, b2, o2, W, T,
                                                 nthreads, avx2) != 0) {
        int64_t r = 0;
#pragma omp parallel for schedule(static) if (rows * cols >= PAR_MIN)
        for (r = 0; r < rows; ++r) {
            float mean = row_mean_sq(grad, gdt, r, cols, W, T, single, avx2);
            v_row_new[r] = v_row_old[r] * b2 + mean * o2;
        }
        column_sums(grad, gdt, rows, cols, W / 2, T, partials, nthreads);
    }
    partials[cols] = tsum_d_f32(v_row_new, rows, W / 2, T);
    return 0;
}

/* ----- the quantiser ------------------------------------------------------------------------ */

/* Bucket of x in [-1, 1]: monotone non-decreasing in x (fp32 add, exact power-of-two scale,
 * truncation), so a threshold in a lower bucket is < x and one in a higher bucket is > x. */
static inline int32_t bucket_of(float x, float hm, int32_t M) {
    float y = (x + 1.0f) * hm;
    int32_t b = (int32_t)y;
    return b > M - 1 ? M - 1 : (b < 0 ? 0 : b);
}

/* The LUT, one uint16 per bucket b < M: lo | (mixed << 8), where lo = number of thresholds (< 1)
 * in buckets below b and mixed = bucket b holds a threshold; entry M (NaN) = K - 1.  For x in
 * bucket b the code is lo when the bucket is not mixed, else
 *     lo + (thr[lo] < x) + (thr[lo + 1] < x)
 * (exact with at most 2 thresholds per bucket: thr is sorted, so thr[lo] is the first threshold
 * in bucket b or above, and any threshold in a higher bucket, >= 1, or the +inf padding is > x).
 * With M = 65536 a learned codebook (centres >= 2/4096 apart) has <= 1 threshold per bucket and
 * ~0.4% of the buckets are mixed.  Returns the largest number of thresholds (< 1) in one bucket
 * (the LUT is usable when <= 2), or -1 (out of memory). */
GEFEN_EXPORT int gefen_build_lut(const float *thr, int32_t nthr, int32_t M, int32_t K, uint16_t *lut) {
    const float hm = (float)(M / 2);
    int32_t *cnt = (int32_t *)calloc((size_t)M, sizeof(int32_t));
    if (!cnt) return -1;
    for (int32_t i = 0; i < nthr; ++i)
        if (thr[i] < 1.0f) cnt[bucket_of(thr[i], hm, M)]++;
    int32_t run = 0, most = 0;
    for (int32_t b = 0; b < M; ++b) {
        lut[b] = (uint16_t)(run | (cnt[b] ? 0x100 : 0));
        run += cnt[b];
        if (cnt[b] > most) most = cnt[b];
    }
    lut[M] = (uint16_t)(K - 1);
    free(cnt);
    return most;
}

/* ----- phase 2: the update ------------------------------------------------------------------ */

typedef struct {
    GEFEN_ARGS_HEAD;
    uint8_t *codes;
    float *scales;
    float *v;               /* block second moment [rows*bpr] (block path) */
    const float *v_row_new; /* factored: phase-1 result */
    float *v_row;           /* factored: state, overwritten with v_row_new */
    float *v_col;           /* factored: state, EMA updated here */
    const double *partials; /* factored: globally summed [cols + 1] */
    const float *codebook;  /* [K] */
    const float *thr;       /* [258]: code_thresholds padded with +inf */
    const uint16_t *lut;    /* [lut_M + 1] (gefen_build_lut), unused when lut_M == 0 (binary search) */
    int64_t rows, bpr, period, global_rows;
    int32_t K, lut_M, W, T, factored;
    int32_t scale_mode; /* 0: torch.maximum(amax, -amin) (gefen.quant today); 1: abs().amax() */
    int32_t momentum_only; /* 1: only m = lerp(m, g, omb1) re-quantised, dequantised into m_out
                              (gefen.functional.update_momentum_, GefenMuon's momentum) */
    float *m_out;          /* momentum_only: [rows * bpr * period] */
    const float *given_scales; /* momentum_only, or NULL: the blocks' scales given (a column split's, reduced over tp) */
    float *scales_out;         /* momentum_only, or NULL: only each block's scale, written here; nothing else */
} gefen_step_args;

typedef struct {
    const gefen_step_args *a;
    int64_t P, NB, cols;
    hyper_f32 s;
    float rm, hm;
    float lerp_coeff; /* lerp weight, or weight - 1 when |weight| >= 0.5 (ATen's lerp) */
    int lerp_small;   /* |weight| < 0.5: lerp = fma(w, end - self, self), else fma(w - 1, end - self, end) */
    int vec2;         /* 2 * W: torch's elementwise vector step */
    int avx2;         /* the call may run the AVX2 kernels */
} kctx;

/* The block scale as gefen.quant.quantise forms it.  scale_mode 0: torch.maximum(amax, -amin)
 * on the [rows, bpr] scale tensor: x86 max_ps semantics in the vectorised part of each thread
 * chunk (ties such as (+0, -0) give the second operand, NaN gives all-ones), std::max in the
 * scalar tail (ties give the first, NaN the canonical NaN). */
static inline float block_scale(const kctx *c, int64_t bi, float amax, float amin, int nan) {
    float nm = -amin;
    if (c->a->scale_mode == 1) { /* |m|.amax(): NaN propagates, zeros are +0 */
        if (nan) return bits_f32(0x7FC00000u);
        float r = amax > nm ? amax : nm;
        return r == 0.0f ? 0.0f : r;
    }
    int64_t b0 = 0, e0 = c->NB;
    if (c->NB >= GRAIN && c->a->T > 1) {
        int64_t nt = min64(c->a->T, divup(c->NB, GRAIN)), chunk = divup(c->NB, nt);
        b0 = bi / chunk * chunk;
        e0 = min64(c->NB, b0 + chunk);
    }
    int vec = (bi - b0) < (e0 - b0) / c->vec2 * c->vec2;
    if (nan) return vec ? bits_f32(0xFFFFFFFFu) : bits_f32(0x7FC00000u);
    if (amax == nm) return vec ? nm : amax;
    return amax > nm ? amax : nm;
}

/* m = lerp(m0, g, w) exactly as ATen computes it (both in its vector body and scalar tail). */
static inline float lerp_m(const kctx *c, float m0, float g) {
    return fmaf(c->lerp_coeff, g - m0, c->lerp_small ? m0 : g);
}

/* Number of thresholds below x (NaN -> K - 1), through bucket b of the LUT or by binary search. */
static inline int32_t code_of(const kctx *c, float x, int32_t b) {
    const gefen_step_args *a = c->a;
    if (a->lut_M) {
        const int32_t lo = a->lut[b] & 0xFF;
        return lo + (a->thr[lo] < x) + (a->thr[lo + 1] < x);
    }
    if (x != x) return a->K - 1;
    int32_t idx = 0;
    for (int32_t s = 128; s; s >>= 1)
        if (a->thr[idx + s - 1] < x) idx += s;
    return idx;
}

static inline int32_t bucket_or_nan(const kctx *c, float x) {
    return x != x ? c->a->lut_M : bucket_of(x, c->hm, c->a->lut_M);
}

/* ----- square roots (torch's: the call's mode, see gefen_common.h) ----------------------------- */
static CLONES void scale_shift(float *q, int64_t n, float b2s, float eps) {
    for (int64_t i = 0; i < n; ++i) q[i] = q[i] / b2s + eps;
}

/* den[i] = sqrt(q[i]) / sqrt(1 - b2^t) + eps, in place. */
static void finish_denominators(const kctx *c, float *q, int64_t n) {
    mode_sqrt_n(c->a->mode, q, n);
    scale_shift(q, n, c->s.b2s, c->s.eps);
}

/* Block path: update v for blocks [b0, b1) and write their denominators to den. */
static void block_denominators(const kctx *c, int64_t b0, int64_t b1, float *den) {
    const gefen_step_args *a = c->a;
    for (int64_t bi = b0; bi < b1; ++bi) {
        float bs = tsum_sq(a->grad, a->grad_dtype, bi * c->P, c->P, a->W, a->T, c->NB == 1, c->avx2) / (float)c->P;
        float v = fmaf(bs, c->s.o2, a->v[bi] * c->s.b2);
        a->v[bi] = v;
        den[bi - b0] = v;
    }
    finish_denominators(c, den, b1 - b0);
}

static CLONES void outer_over(float *den, const float *vc, int64_t n, float vr, float rm) {
    for (int64_t j = 0; j < n; ++j) den[j] = (vr * vc[j]) / rm;
}

/* Factored path: sqrt(v_row * v_col / mean(v_row)) for row r, columns [j0, j1). */
static void row_denominators(const kctx *c, int64_t r, int64_t j0, int64_t j1, float *den) {
    outer_over(den, c->a->v_col + j0, j1 - j0, c->a->v_row[r], c->rm);
    mode_sqrt_n(c->a->mode, den, j1 - j0); /* "/ sqrt(1 - b2^t) + eps" happens in the block kernels (den_stride 1) */
}

/* ----- one block ------------------------------------------------------------------------------
 * Pass 1: m = lerp(codebook[code] * scale, g) for the block, its max-abs -> the new scale.
 * Pass 2: code = nearest(m / scale), u = codebook[code] * scale / (1 - b1^t) / den,
 *         p = p * (1 - lr wd) - lr u  (one fused multiply-add, as torch's add(alpha)).
 * Buffers (P entries each): mbuf (m, then m / scale), cbuf (codebook values), bbuf (buckets). */
typedef struct {
    float *mbuf, *cbuf;
    int32_t *bbuf;
} block_bufs;

/* One block, portable C. den is the block's denominator (one value on the block path,
 * den_stride = 0) or, factored (den_stride = 1), one square root per element that still needs
 * "/ sqrt(1 - b2^t) + eps". */
static void block_portable(const kctx *c, int64_t bi, const block_bufs *B, const float *den, int den_stride) {
    const gefen_step_args *a = c->a;
    const int64_t P = c->P, off = bi * P;
    const float *cb = a->codebook;
    float *mbuf = B->mbuf;
    uint8_t *code = a->codes + off;
    const float s_old = a->scales[bi];
    float amax = -INFINITY, amin = INFINITY;
    int nan = 0;
    for (int64_t e = 0; e < P; ++e) {
        float m0 = cb[code[e]] * s_old;
        float m = lerp_m(c, m0, ld_g(a->grad, a->grad_dtype, off + e));
        mbuf[e] = m;
        nan |= m != m;
        amax = m > amax ? m : amax;
        amin = m < amin ? m : amin;
    }
    const float scale = a->given_scales ? a->given_scales[bi] : block_scale(c, bi, amax, amin, nan);
    if (a->scales_out) {
        a->scales_out[bi] = scale;
        return;
    }
    const int zero = scale == 0.0f;
    for (int64_t e = 0; e < P; ++e) {
        int32_t q = 0;
        if (!zero) {
            float x = mbuf[e] / scale;
            q = code_of(c, x, a->lut_M ? bucket_or_nan(c, x) : 0);
        }
        float u = cb[q] * scale;
        code[e] = (uint8_t)q;
        if (a->momentum_only) {
            a->m_out[off + e] = u;
            continue;
        }
        update_param(a->param, a->param_dtype, off + e, u / c->s.bc1,
                     den_stride ? den[e] / c->s.b2s + c->s.eps : den[0], &c->s, a->has_wd);
    }
    a->scales[bi] = scale;
}

/* P == 1, block path: every element is its own block (1-D / 0-D tensors).  den: i1 - i0 floats. */
static void elementwise_portable(const kctx *c, int64_t i0, int64_t i1, float *den) {
    const gefen_step_args *a = c->a;
    const float *cb = a->codebook;
    for (int64_t i = i0; i < i1; ++i) {
        float g = ld_g(a->grad, a->grad_dtype, i);
        float v = fmaf(0.0f + g * g, c->s.o2, a->v[i] * c->s.b2);
        a->v[i] = v;
        den[i - i0] = v;
    }
    finish_denominators(c, den, i1 - i0);
    for (int64_t i = i0; i < i1; ++i) {
        float m0 = cb[a->codes[i]] * a->scales[i];
        float m = lerp_m(c, m0, ld_g(a->grad, a->grad_dtype, i));
        float scale = block_scale(c, i, m, m, m != m);
        int32_t q = 0;
        if (scale != 0.0f) {
            float x = m / scale;
            q = code_of(c, x, a->lut_M ? bucket_or_nan(c, x) : 0);
        }
        update_param(a->param, a->param_dtype, i, cb[q] * scale / c->s.bc1, den[i - i0], &c->s, a->has_wd);
        a->codes[i] = (uint8_t)q;
        a->scales[i] = scale;
    }
}

/* Table lookups stay scalar: AVX2 gathers are several times slower than plain loads on the
 * CPUs we measured, and these loops are load-port bound (2-5 loads per element). */
#define NOVEC __attribute__((noinline, optimize("no-tree-vectorize", "unroll-loops")))

static NOVEC void lookup_values(const uint8_t *code, const float *cb, float *out, int64_t n) {
    int64_t e = 0;
    for (; e + 4 <= n; e += 4) {
        out[e] = cb[code[e]];
        out[e + 1] = cb[code[e + 1]];
        out[e + 2] = cb[code[e + 2]];
        out[e + 3] = cb[code[e + 3]];
    }
    for (; e < n; ++e) out[e] = cb[code[e]];
}

/* codes of x[0 .. n) (already divided by the scale, bucketed in b) and their codebook values */
static NOVEC void lookup_codes(const kctx *c, const float *x, const int32_t *b, uint8_t *code, float *out,
                               int64_t n) {
    const float *cb = c->a->codebook, *thr = c->a->thr;
    const uint16_t *lut = c->a->lut;
    if (c->a->lut_M) {
        for (int64_t e = 0; e < n; ++e) {
            const uint32_t E = lut[b[e]];
            int32_t q = (int32_t)(E & 0xFF);
            if (__builtin_expect(E >> 8, 0)) q += (thr[q] < x[e]) + (thr[q + 1] < x[e]);
            code[e] = (uint8_t)q;
            out[e] = cb[q];
        }
        return;
    }
    for (int64_t e = 0; e < n; ++e) {
        int32_t q = code_of(c, x[e], 0);
        code[e] = (uint8_t)q;
        out[e] = cb[q];
    }
}

#if GEFEN_X86
static AVX2 float hmin8(__m256 v) {
    float t[8];
    _mm256_storeu_ps(t, v);
    float m = t[0];
    for (int i = 1; i < 8; ++i) m = t[i] < m ? t[i] : m;
    return m;
}

static AVX2 void block_avx2(const kctx *c, int64_t bi, const block_bufs *B, const float *den, int den_stride) {
    const gefen_step_args *a = c->a;
    const int64_t P = c->P, off = bi * P;
    const int64_t P8 = P & ~(int64_t)7;
    const float *cb = a->codebook;
    float *mbuf = B->mbuf, *cbuf = B->cbuf;
    int32_t *bbuf = B->bbuf;
    uint8_t *code = a->codes + off;
    const float s_old = a->scales[bi];

    /* pass 1 */
    lookup_values(code, cb, cbuf, P);
    const __m256 vs_old = _mm256_set1_ps(s_old), w = _mm256_set1_ps(c->lerp_coeff);
    __m256 vmax = _mm256_set1_ps(-INFINITY), vmin = _mm256_set1_ps(INFINITY), vnan = _mm256_setzero_ps();
    int64_t e = 0;
    const int gsz = DT_SIZE(a->grad_dtype), psz = DT_SIZE(a->param_dtype);
    for (; e < P8; e += 8) {
        PREFETCH(a->grad, gsz, off + e);
        PREFETCH(a->codes, 1, off + e);
        __m256 m0 = _mm256_mul_ps(_mm256_loadu_ps(cbuf + e), vs_old);
        __m256 g = ld8_g(a->grad, a->grad_dtype, off + e);
        __m256 m = _mm256_fmadd_ps(w, _mm256_sub_ps(g, m0), c->lerp_small ? m0 : g);
        _mm256_storeu_ps(mbuf + e, m);
        vnan = _mm256_or_ps(vnan, _mm256_cmp_ps(m, m, _CMP_UNORD_Q));
        vmax = _mm256_max_ps(vmax, m);
        vmin = _mm256_min_ps(vmin, m);
    }
    float amax = hmax8(vmax), amin = hmin8(vmin);
    int nan = _mm256_movemask_ps(vnan) != 0;
    for (; e < P; ++e) {
        float m = lerp_m(c, cbuf[e] * s_old, ld_g(a->grad, a->grad_dtype, off + e));
        mbuf[e] = m;
        nan |= m != m;
        amax = m > amax ? m : amax;
        amin = m < amin ? m : amin;
    }
    const float scale = a->given_scales ? a->given_scales[bi] : block_scale(c, bi, amax, amin, nan);
    if (a->scales_out) {
        a->scales_out[bi] = scale;
        return;
    }
    const __m256 vscale = _mm256_set1_ps(scale);

    /* pass 2: normalise and bucket (vector), look up codes (scalar), update (vector) */
    if (scale == 0.0f) {
        memset(code, 0, (size_t)P);
        for (e = 0; e < P; ++e) cbuf[e] = cb[0];
    } else {
        const int32_t M = a->lut_M;
        const __m256 one = _mm256_set1_ps(1.0f), hm = _mm256_set1_ps(c->hm);
        const __m256i top = _mm256_set1_epi32(M - 1), nanb = _mm256_set1_epi32(M), zero = _mm256_setzero_si256();
        for (e = 0; e < P8; e += 8) {
            __m256 x = _mm256_div_ps(_mm256_loadu_ps(mbuf + e), vscale);
            _mm256_storeu_ps(mbuf + e, x);
            __m256 isnan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
            __m256i b = _mm256_cvttps_epi32(_mm256_mul_ps(_mm256_add_ps(_mm256_andnot_ps(isnan, x), one), hm));
            b = _mm256_max_epi32(_mm256_min_epi32(b, top), zero);
            _mm256_storeu_si256((__m256i *)(bbuf + e), _mm256_blendv_epi8(b, nanb, _mm256_castps_si256(isnan)));
        }
        for (; e < P; ++e) {
            float x = mbuf[e] / scale;
            mbuf[e] = x;
            bbuf[e] = M ? bucket_or_nan(c, x) : 0;
        }
        lookup_codes(c, mbuf, bbuf, code, cbuf, P);
    }
    if (a->momentum_only) { /* the dequantised new momentum: codebook[code] * scale */
        for (e = 0; e < P8; e += 8) _mm256_storeu_ps(a->m_out + off + e, _mm256_mul_ps(_mm256_loadu_ps(cbuf + e), vscale));
        for (; e < P; ++e) a->m_out[off + e] = cbuf[e] * scale;
        a->scales[bi] = scale;
        return;
    }
    const __m256 b1 = _mm256_set1_ps(c->s.bc1), vden_b = _mm256_set1_ps(den[0]);
    const __m256 b2s = _mm256_set1_ps(c->s.b2s), eps = _mm256_set1_ps(c->s.eps);
    const __m256 nlr = _mm256_set1_ps(c->s.nlr), decay = _mm256_set1_ps(c->s.decay);
    for (e = 0; e < P8; e += 8) {
        PREFETCH(a->param, psz, off + e);
        __m256 u = _mm256_div_ps(_mm256_mul_ps(_mm256_loadu_ps(cbuf + e), vscale), b1);
        u = _mm256_div_ps(u, den_stride ? _mm256_add_ps(_mm256_div_ps(_mm256_loadu_ps(den + e), b2s), eps) : vden_b);
        update_param8(a->param, a->param_dtype, off + e, u, nlr, decay, a->has_wd);
    }
    for (; e < P; ++e)
        update_param(a->param, a->param_dtype, off + e, cbuf[e] * scale / c->s.bc1,
                     den_stride ? den[e] / c->s.b2s + c->s.eps : den[0], &c->s, a->has_wd);
    a->scales[bi] = scale;
}
#endif

static inline void one_block(const kctx *c, int64_t bi, const block_bufs *B, const float *den, int den_stride) {
#if GEFEN_X86
    if (c->avx2 && c->P >= 8) {
        block_avx2(c, bi, B, den, den_stride);
        return;
    }
#endif
    block_portable(c, bi, B, den, den_stride);
}

#define BLOCK_CHUNK_ELEMS 16384 /* block path: blocks whose denominators are batched together */
#define ELEM_CHUNK 4096         /* P == 1: elements per batch */

/* Blocks [b0, b1) of one thread. den: den_len floats. */
static void run_blocks(const kctx *c, int64_t b0, int64_t b1, const block_bufs *B, float *den) {
    const gefen_step_args *a = c->a;
    if (a->momentum_only) { /* no second moment, no parameter: blocks only (P == 1 included) */
        for (int64_t bi = b0; bi < b1; ++bi) one_block(c, bi, B, den, 0);
        return;
    }
    if (!a->factored && c->P == 1) {
        for (int64_t i = b0; i < b1; i += ELEM_CHUNK) elementwise_portable(c, i, min64(i + ELEM_CHUNK, b1), den);
        return;
    }
    if (!a->factored) {
        int64_t per = BLOCK_CHUNK_ELEMS / c->P;
        per = per < 1 ? 1 : (per > ELEM_CHUNK ? ELEM_CHUNK : per);
        for (int64_t k0 = b0; k0 < b1; k0 += per) {
            int64_t k1 = min64(k0 + per, b1);
            block_denominators(c, k0, k1, den);
            for (int64_t bi = k0; bi < k1; ++bi) one_block(c, bi, B, den + (bi - k0), 0);
        }
        return;
    }
    /* factored: the denominators of each row segment, then its blocks */
    const int64_t bpr = a->bpr, P = c->P;
    for (int64_t bi = b0; bi < b1;) {
        int64_t r = bi / bpr, end = min64((r + 1) * bpr, b1);
        int64_t j0 = (bi - r * bpr) * P, j1 = (end - r * bpr) * P;
        row_denominators(c, r, j0, j1, den);
        for (int64_t k = bi; k < end; ++k) one_block(c, k, B, den + ((k - r * bpr) * P - j0), 1);
        bi = end;
    }
}

/* One Gefen step for one (rank-local) parameter; see gefen.functional.gefen_update_.  With
 * momentum_only, just the momentum half (gefen.functional.update_momentum_): codes and scales
 * updated in place, the dequantised momentum written to m_out, nothing else touched.
 * Returns 0, -1 when out of memory (nothing modified), -2 on bad arguments (nothing modified). */
GEFEN_EXPORT int gefen_step(const gefen_step_args *a) {
    if (a->T < 1 || a->T > MAX_T || (a->W != 8 && a->W != 16) || a->period < 1 || a->K < 2 || a->K > 256 ||
        (a->lut_M && !a->lut) || (a->momentum_only && ((!a->m_out && !a->scales_out) || a->factored)) || !a->mode)
        return -2;
    if ((a->given_scales || a->scales_out) && !a->momentum_only) return -2;
    kctx c;
    c.a = a;
    c.P = a->period;
    c.NB = a->rows * a->bpr;
    c.cols = a->bpr * a->period;
    c.s = HYPER_F32(a);
    c.lerp_small = fabsf(c.s.o1) < 0.5f;
    c.lerp_coeff = c.lerp_small ? c.s.o1 : c.s.o1 - 1.0f;
    c.hm = (float)(a->lut_M / 2);
    c.vec2 = 2 * a->W;
    c.rm = 0.0f;
    c.avx2 = call_isa(a->mode) >= 1;
    const int64_t numel = c.NB * c.P;
    const int nthreads = max_threads();
    const int par = numel >= PAR_MIN && nthreads > 1;
    (void)par;
    const int64_t den_len = a->factored ? c.cols : ELEM_CHUNK;
    const int64_t stride = (c.P + 15) / 16 * 16 + 48; /* floats; odd multiple of 64 B apart (no 4K aliasing) */
    const int64_t per_thread = 3 * stride + den_len + 48;

    float *bufs = (float *)malloc((size_t)nthreads * (size_t)per_thread * sizeof(float));
    if (!bufs) return -1;
    if (a->factored && !a->momentum_only) { /* finish the second moment (tiny) */
        if (a->rows) memcpy(a->v_row, a->v_row_new, (size_t)a->rows * sizeof(float));
        const double R = (double)a->global_rows;
        for (int64_t j = 0; j < c.cols; ++j) {
            float cm = (float)(a->partials[j] / R);
            a->v_col[j] = fmaf(cm, c.s.o2, a->v_col[j] * c.s.b2);
        }
        float rm = (float)(a->partials[c.cols] / R);
        c.rm = rm < FLT_MIN ? FLT_MIN : rm;
    }
    if (a->step_ptr && !a->momentum_only) *a->step_ptr = a->step;

#pragma omp parallel if (par)
    {
        int64_t b0, b1;
        thread_range(c.NB, &b0, &b1);
        const int mkl_prev = mode_threads_begin(a->mode);
        float *mine = bufs + (size_t)thread_id() * (size_t)per_thread;
        block_bufs B = {mine, mine + stride, (int32_t *)(mine + 2 * stride)};
        run_blocks(&c, b0, b1, &B, mine + 3 * stride);
        mode_threads_end(a->mode, mkl_prev);
    }
    free(bufs);
    return 0;
}

GEFEN_EXPORT int gefen_native_abi(void) { return GEFEN_ABI; }
/* The OpenMP thread count of the calling thread's next kernels (gefen.native passes torch's, so
 * torch.set_num_threads governs both; the results do not depend on it). */
GEFEN_EXPORT void gefen_set_threads(int32_t n) {
#ifdef _OPENMP
    if (n > 0 && n != omp_get_max_threads()) omp_set_num_threads(n);
#else
    (void)n;
#endif
}
/* the widest kernels this CPU runs (gefen_mode.isa: 0 portable, 1 AVX2, 2 AVX-512) */
GEFEN_EXPORT int gefen_cpu_isa(void) { return cpu_isa(); }
