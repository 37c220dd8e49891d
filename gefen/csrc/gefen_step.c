/*
 * The fused CPU step of Gefen's "m8" state layout: phase 2 (gefen_step: the second moment's EMA,
 * decode, the first moment's EMA, re-encode, the parameter update), also the momentum alone
 * (GefenMuon's); phase 1 of a factored tensor is m4v4_step.c's gefen_m4v4_partials.  Part of
 * gefen._gefen_step, loaded by gefen.c_kernels.  The contract and its bound of the reference
 * (gefen.functional.m8_update_) are docs/design.md's "The m8 kernel"; how the kernels keep it:
 *   - The first moment is exact: the EMA is torch's lerp (one fmaf, both of ATen's formulas), a
 *     zero scale is +0, any NaN the canonical one, and the nearest code is the number of fp32
 *     thresholds (gefen.codebook.code_thresholds) strictly below m / scale (NaN -> the last code),
 *     counted through a bucket LUT (exact: see gefen_build_lut) or by binary search when no LUT fits.
 *   - The second moment's EMA keeps torch's add(alpha) fmaf, the parameter update its one fmaf
 *     (p + (-lr) u); no other contraction (-ffp-contract=off).
 * Each block belongs to one thread, so any thread split gives the same bits.  The three block
 * kernels (AVX-512, AVX2, portable C; the call's mode caps which runs) do the same operations lane
 * by lane.  The LUT lookups of the codes stay scalar in every kernel: gathers (AVX2's, and
 * AVX-512's of the LUT) were slower on L2-resident tensors.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gefen_common.h"

#define GEFEN_ABI 20
#define PAR_MIN 32768 /* below this many elements a tensor is processed by one thread */

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
    int32_t K, lut_M, factored;
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
    float rm, hm, ibc1, ib2s; /* mean(v_row), the LUT's bucket scale, 1 / (1 - b1^t), 1 / sqrt(1 - b2^t) */
    float lerp_coeff; /* lerp weight, or weight - 1 when |weight| >= 0.5 (ATen's lerp) */
    int lerp_small;   /* |weight| < 0.5: lerp = fma(w, end - self, self), else fma(w - 1, end - self, end) */
    int isa;          /* call_isa: 0 portable, 1 AVX2, 2 AVX-512 */
    int want_v;       /* the per-block path: each block's pass 1 also sums g^2 (block_den) */
    const float *svc; /* factored: sqrt(v_col') per column */
    float cb256[256]; /* the codebook padded with zeros to 256 entries (the 16-lane kernel's registers) */
} kctx;

/* m = lerp(m0, g, w) exactly as ATen computes it (both in its vector body and scalar tail). */
static inline float lerp_m(const kctx *c, float m0, float g) {
    return fmaf(c->lerp_coeff, g - m0, c->lerp_small ? m0 : g);
}

static inline int32_t bucket_or_nan(const kctx *c, float x) {
    return x != x ? c->a->lut_M : bucket_of(x, c->hm, c->a->lut_M);
}

/* Number of thresholds below x (NaN -> K - 1), through x's bucket of the LUT or by binary search. */
static inline int32_t code_of(const kctx *c, float x) {
    const gefen_step_args *a = c->a;
    if (a->lut_M) {
        const int32_t lo = a->lut[bucket_or_nan(c, x)] & 0xFF;
        return lo + (a->thr[lo] < x) + (a->thr[lo + 1] < x);
    }
    if (x != x) return a->K - 1;
    int32_t idx = 0;
    for (int32_t s = 128; s; s >>= 1)
        if (a->thr[idx + s - 1] < x) idx += s;
    return idx;
}

/* ----- one block ------------------------------------------------------------------------------
 * Pass 1: m = lerp(codebook[code] * scale, g) for the block, its max-abs -> the new scale; on the
 *         per-block path (want_v) also the block's float64 sum of g^2 in p1_row's order, so the
 *         gradient is read once (block_den then gives the second moment and the denominator).
 * Pass 2: code = nearest(m / scale), m_hat = (codebook[code] * scale) * (1 / (1 - b1^t)),
 *         u = m_hat / bounded_den(root, m_hat), p = p * (1 - lr wd) + (-lr) u  (one fused
 *         multiply-add, as torch's add(alpha)).
 * den: the block's sqrt(v) / sqrt(1 - b2^t), or (svc != NULL, factored) the root sa * svc[e] per
 * element, where sa = sqrt(v_row / mean(v_row)) / sqrt(1 - b2^t) and svc = sqrt(v_col') of the
 * block's columns.  The vector kernels end each pass with the scalar loops of the portable one.
 * Buffers (P entries each): mbuf (m, then m / scale), cbuf (codebook values), bbuf (buckets). */
typedef struct {
    float *mbuf, *cbuf;
    int32_t *bbuf;
} block_bufs;

/* What pass 1 gathers: the largest |m| and whether an m is NaN (see max_abs_bits), the sum of g^2
 * (its lanes and tail, see lanes_total). */
typedef struct {
    float most;
    int nan;
    double lanes[16], tail;
} pass1_sums;

/* The scalar end of a vector kernel's pass 1 (elements e0 .. P of block bi), into mbuf and S. */
static inline void pass1_scalar(const kctx *c, int64_t bi, int64_t e0, float s_old, float *mbuf, pass1_sums *S) {
    const gefen_step_args *a = c->a;
    const int64_t off = bi * c->P, P16 = c->P & ~(int64_t)15;
    for (int64_t e = e0; e < c->P; ++e) {
        const float g = ld_g(a->grad, a->grad_dtype, off + e);
        const float m = lerp_m(c, a->codebook[a->codes[off + e]] * s_old, g);
        mbuf[e] = m;
        fold_max_abs(m, &S->most, &S->nan);
        if (!c->want_v) continue;
        const double s = (double)(g * g);
        if (e < P16) S->lanes[e & 15] += s;
        else S->tail += s;
    }
}

/* The per-block path's v and sqrt(v) / sqrt(1 - b2^t) from the block's sum of g^2: its mean
 * rounded once, the EMA as torch's add(alpha) (one fmaf). */
static inline float block_den(const kctx *c, int64_t bi, const pass1_sums *S) {
    const float bs = (float)(lanes_total(S->lanes, S->tail) / (double)c->P);
    const float v = fmaf(bs, c->s.o2, c->a->v[bi] * c->s.b2);
    c->a->v[bi] = v;
    return sqrtf(v) * c->ib2s;
}

/* The end of pass 1: the block's scale (given, or its max |m|: NaN when an m is) and, on the
 * per-block path, its den.  0: only the scale was asked for (written to scales_out). */
static inline int pass1_end(const kctx *c, int64_t bi, const pass1_sums *S, float *scale, float *den) {
    const gefen_step_args *a = c->a;
    *scale = a->given_scales ? a->given_scales[bi] : S->nan ? NAN : S->most;
    if (a->scales_out) {
        a->scales_out[bi] = *scale;
        return 0;
    }
    if (c->want_v) *den = block_den(c, bi, S);
    return 1;
}

/* The scalar end of a vector kernel's pass 2 (elements e0 .. P of block bi, their new codes
 * written), then the block's new scale: the dequantised momentum codebook[code] * scale into m_out,
 * or the parameter update. */
static inline void pass2_scalar(const kctx *c, int64_t bi, int64_t e0, float scale, float den, const float *svc) {
    const gefen_step_args *a = c->a;
    const int64_t off = bi * c->P;
    for (int64_t e = e0; e < c->P; ++e) {
        const float value = a->codebook[a->codes[off + e]] * scale;
        if (a->momentum_only) {
            a->m_out[off + e] = value;
            continue;
        }
        const float m_hat = value * c->ibc1, root = svc ? den * svc[e] : den;
        update_param(a->param, a->param_dtype, off + e, m_hat, bounded_den(root, m_hat, c->s.ib, c->s.eps), &c->s,
                     a->has_wd);
    }
    a->scales[bi] = scale;
}

/* The scalar kernel (what blocks of P < 8 run, e.g. a 1-D tensor's P = 1) keeps its own fused
 * loops: built from the vector kernels' tail loops above it took 18% longer on P = 1 blocks. */

/* The block scale max(max m, -min m) (any NaN: NaN; a zero scale: +0, whatever the zeros' signs). */
static inline float block_scale(float amax, float amin, int nan) {
    if (nan) return NAN;
    const float nm = -amin, r = amax > nm ? amax : nm;
    return r == 0.0f ? 0.0f : r;
}

static void block_portable(const kctx *c, int64_t bi, const block_bufs *B, float den, const float *svc) {
    const gefen_step_args *a = c->a;
    const int64_t P = c->P, off = bi * P, P16 = P & ~(int64_t)15;
    const float *cb = a->codebook;
    float *mbuf = B->mbuf;
    uint8_t *code = a->codes + off;
    const float s_old = a->scales[bi];
    float amax = -INFINITY, amin = INFINITY;
    double lanes[16] = {0}, tail = 0.0;
    int nan = 0;
    for (int64_t e = 0; e < P; ++e) {
        const float g = ld_g(a->grad, a->grad_dtype, off + e);
        float m = lerp_m(c, cb[code[e]] * s_old, g);
        mbuf[e] = m;
        nan |= m != m;
        amax = m > amax ? m : amax;
        amin = m < amin ? m : amin;
        if (c->want_v) {
            const double s = (double)(g * g);
            if (e < P16) lanes[e & 15] += s;
            else tail += s;
        }
    }
    const float scale = a->given_scales ? a->given_scales[bi] : block_scale(amax, amin, nan);
    if (a->scales_out) {
        a->scales_out[bi] = scale;
        return;
    }
    if (c->want_v) {
        const float bs = (float)(lanes_total(lanes, tail) / (double)c->P);
        const float v = fmaf(bs, c->s.o2, c->a->v[bi] * c->s.b2);
        c->a->v[bi] = v;
        den = sqrtf(v) * c->ib2s;
    }
    const int zero = scale == 0.0f;
    for (int64_t e = 0; e < P; ++e) {
        int32_t q = 0;
        if (!zero) {
            float x = mbuf[e] / scale;
            q = code_of(c, x);
        }
        float u = cb[q] * scale;
        code[e] = (uint8_t)q;
        if (a->momentum_only) {
            a->m_out[off + e] = u;
            continue;
        }
        u = u * c->ibc1;
        u = u / bounded_den(svc ? den * svc[e] : den, u, c->s.ib, c->s.eps);
        float p = ld_g(a->param, a->param_dtype, off + e);
        if (a->has_wd) p = p * c->s.decay;
        st_g(a->param, a->param_dtype, off + e, fmaf(u, c->s.nlr, p));
    }
    a->scales[bi] = scale;
}

#if GEFEN_X86
/* Table lookups stay scalar: AVX2 gathers are several times slower than plain loads on the
 * CPUs we measured, and these loops are load-port bound (2-5 loads per element). */
#define NOVEC __attribute__((noinline, optimize("no-tree-vectorize", "unroll-loops")))

static NOVEC void lookup_values(const uint8_t *code, const float *cb, float *out, int64_t n) {
    for (int64_t e = 0; e < n; ++e) out[e] = cb[code[e]];
}

/* codes of x[0 .. n) (already divided by the scale, bucketed in b) and their codebook values,
 * unless out is NULL (the LUT path only: the 16-lane kernel looks them up in registers) */
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
            if (out) out[e] = cb[q];
        }
        return;
    }
    for (int64_t e = 0; e < n; ++e) {
        int32_t q = code_of(c, x[e]);
        code[e] = (uint8_t)q;
        out[e] = cb[q];
    }
}

/* Pass 2's start where the new scale is 0: every code 0, its value codebook[0]. */
static void zero_codes(const kctx *c, uint8_t *code, float *cbuf) {
    memset(code, 0, (size_t)c->P);
    for (int64_t e = 0; e < c->P; ++e) cbuf[e] = c->a->codebook[0];
}

/* The scalar end of a vector kernel's bucketing (elements e0 .. P): mbuf[e] /= scale, its bucket. */
static void bucket_tail(const kctx *c, int64_t e0, float scale, float *mbuf, int32_t *bbuf) {
    for (int64_t e = e0; e < c->P; ++e) {
        const float x = mbuf[e] / scale;
        mbuf[e] = x;
        bbuf[e] = c->a->lut_M ? bucket_or_nan(c, x) : 0;
    }
}

static AVX2 void block_avx2(const kctx *c, int64_t bi, const block_bufs *B, float den, const float *svc) {
    const gefen_step_args *a = c->a;
    const int64_t P = c->P, off = bi * P;
    const int64_t P8 = P & ~(int64_t)7, P16 = P & ~(int64_t)15;
    float *mbuf = B->mbuf, *cbuf = B->cbuf;
    int32_t *bbuf = B->bbuf;
    uint8_t *code = a->codes + off;
    const float s_old = a->scales[bi];

    /* pass 1 */
    lookup_values(code, a->codebook, cbuf, P8);
    const __m256 vs_old = _mm256_set1_ps(s_old), w = _mm256_set1_ps(c->lerp_coeff);
    __m256i vmax = _mm256_setzero_si256(); /* max |m| as bits */
    __m256d l0 = _mm256_setzero_pd(), l1 = l0, l2 = l0, l3 = l0; /* the sum's lanes 0-3, 4-7, 8-11, 12-15 */
    pass1_sums S = {0};
    int64_t e = 0;
    const int gsz = DT_SIZE(a->grad_dtype), psz = DT_SIZE(a->param_dtype);
    for (; e < P8; e += 8) {
        PREFETCH(a->grad, gsz, off + e);
        PREFETCH(a->codes, 1, off + e);
        __m256 m0 = _mm256_mul_ps(_mm256_loadu_ps(cbuf + e), vs_old);
        __m256 g = ld8_g(a->grad, a->grad_dtype, off + e);
        __m256 m = _mm256_fmadd_ps(w, _mm256_sub_ps(g, m0), c->lerp_small ? m0 : g);
        _mm256_storeu_ps(mbuf + e, m);
        vmax = _mm256_max_epu32(vmax, abs_bits8(m));
        if (!c->want_v) continue;
        const __m256 sq = _mm256_mul_ps(g, g);
        if (e < P16) {
            const __m256d d0 = _mm256_cvtps_pd(_mm256_castps256_ps128(sq));
            const __m256d d1 = _mm256_cvtps_pd(_mm256_extractf128_ps(sq, 1));
            if (e & 8) {
                l2 = _mm256_add_pd(l2, d0);
                l3 = _mm256_add_pd(l3, d1);
            } else {
                l0 = _mm256_add_pd(l0, d0);
                l1 = _mm256_add_pd(l1, d1);
            }
        } else {
            float t[8];
            _mm256_storeu_ps(t, sq);
            for (int k = 0; k < 8; ++k) S.tail += (double)t[k];
        }
    }
    S.most = max_abs_bits(hmax8_u32(vmax), &S.nan);
    _mm256_storeu_pd(S.lanes, l0);
    _mm256_storeu_pd(S.lanes + 4, l1);
    _mm256_storeu_pd(S.lanes + 8, l2);
    _mm256_storeu_pd(S.lanes + 12, l3);
    pass1_scalar(c, bi, e, s_old, mbuf, &S);
    float scale;
    if (!pass1_end(c, bi, &S, &scale, &den)) return;
    const __m256 vscale = _mm256_set1_ps(scale);

    /* pass 2: normalise and bucket (vector), look up codes (scalar), update (vector) */
    if (scale == 0.0f) {
        zero_codes(c, code, cbuf);
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
        bucket_tail(c, e, scale, mbuf, bbuf);
        lookup_codes(c, mbuf, bbuf, code, cbuf, P);
    }
    const __m256 ibc1 = _mm256_set1_ps(c->ibc1), vden = _mm256_set1_ps(den);
    const update8_scalars k = update8_scalars_of(&c->s);
    for (e = 0; e < P8; e += 8) {
        const __m256 value = _mm256_mul_ps(_mm256_loadu_ps(cbuf + e), vscale);
        if (a->momentum_only) { /* the dequantised new momentum */
            _mm256_storeu_ps(a->m_out + off + e, value);
            continue;
        }
        PREFETCH(a->param, psz, off + e);
        const __m256 root = svc ? _mm256_mul_ps(vden, _mm256_loadu_ps(svc + e)) : vden;
        bounded_update8(a->param, a->param_dtype, off + e, _mm256_mul_ps(value, ibc1), root, &k, a->has_wd);
    }
    pass2_scalar(c, bi, e, scale, den, svc);
}

/* ----- 16 lanes ------------------------------------------------------------------------------
 * The AVX2 kernel's operations lane by lane (the max |m| is exact in any order).  In blocks of at
 * least REGS_MIN elements the codebook's values (the decode's and the update's) come from
 * registers: the 256 entries in 16 of them, looked up by 8 two-register permutes and 7 blends on
 * the code's top three bits (exact, as a load; 13% faster in L2, 30% streaming).  In shorter
 * blocks loading the table costs what it saves, and the lookups stay scalar.  (vgatherdps for
 * the values was slower than scalar loads.) */
#define REGS_MIN 128

typedef struct {
    __m512 t[16];
} cb16;

/* codebook[idx] on 16 lanes, idx in 0..255 */
static AVX512 inline __m512 cb16_lookup(const cb16 *T, __m512i idx) {
    __m512 t[8];
    for (int k = 0; k < 8; ++k) t[k] = _mm512_permutex2var_ps(T->t[2 * k], idx, T->t[2 * k + 1]);
    const __mmask16 b5 = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(32));
    const __mmask16 b6 = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(64));
    const __mmask16 b7 = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(128));
    for (int k = 0; k < 4; ++k) t[k] = _mm512_mask_blend_ps(b5, t[2 * k], t[2 * k + 1]);
    for (int k = 0; k < 2; ++k) t[k] = _mm512_mask_blend_ps(b6, t[2 * k], t[2 * k + 1]);
    return _mm512_mask_blend_ps(b7, t[0], t[1]);
}

/* the codebook values of the 16 codes at p: from the registers, or cbuf's scalar lookups */
static AVX512 inline __m512 values16(const cb16 *T, int regs, const uint8_t *p, const float *cbuf) {
    if (!regs) return _mm512_loadu_ps(cbuf);
    return cb16_lookup(T, _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

/* one block; regs (a constant in each caller, so each gets its own code): the values from registers */
static AVX512 inline __attribute__((always_inline)) void block16(const kctx *c, int64_t bi, const block_bufs *B,
                                                                float den, const float *svc, const int regs) {
    const gefen_step_args *a = c->a;
    const int64_t P = c->P, off = bi * P, P16 = P & ~(int64_t)15;
    float *mbuf = B->mbuf, *cbuf = B->cbuf;
    int32_t *bbuf = B->bbuf;
    uint8_t *code = a->codes + off;
    const float s_old = a->scales[bi];
    cb16 T;
    if (regs)
        for (int k = 0; k < 16; ++k) T.t[k] = _mm512_loadu_ps(c->cb256 + 16 * k);

    /* pass 1 */
    if (!regs) lookup_values(code, a->codebook, cbuf, P16);
    const __m512 vs_old = _mm512_set1_ps(s_old), w = _mm512_set1_ps(c->lerp_coeff);
    __m512i vmax = _mm512_setzero_si512(); /* max |m| as bits */
    __m512d l0 = _mm512_setzero_pd(), l1 = l0; /* the sum's lanes 0-7, 8-15 */
    pass1_sums S = {0};
    int64_t e = 0;
    const int gsz = DT_SIZE(a->grad_dtype), psz = DT_SIZE(a->param_dtype);
    for (; e < P16; e += 16) {
        PREFETCH(a->grad, gsz, off + e);
        PREFETCH(a->codes, 1, off + e);
        const __m512 m0 = _mm512_mul_ps(values16(&T, regs, code + e, cbuf + e), vs_old);
        const __m512 g = ld16_g(a->grad, a->grad_dtype, off + e);
        const __m512 m = _mm512_fmadd_ps(w, _mm512_sub_ps(g, m0), c->lerp_small ? m0 : g);
        _mm512_storeu_ps(mbuf + e, m);
        vmax = _mm512_max_epu32(vmax, abs_bits16(m));
        if (!c->want_v) continue;
        const __m512 sq = _mm512_mul_ps(g, g);
        l0 = _mm512_add_pd(l0, _mm512_cvtps_pd(_mm512_castps512_ps256(sq)));
        l1 = _mm512_add_pd(l1, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(sq), 1))));
    }
    S.most = max_abs_bits(_mm512_reduce_max_epu32(vmax), &S.nan);
    _mm512_storeu_pd(S.lanes, l0);
    _mm512_storeu_pd(S.lanes + 8, l1);
    pass1_scalar(c, bi, e, s_old, mbuf, &S);
    float scale;
    if (!pass1_end(c, bi, &S, &scale, &den)) return;
    const __m512 vscale = _mm512_set1_ps(scale);

    /* pass 2: normalise and bucket (vector), look up codes (scalar), update (vector) */
    const int32_t M = a->lut_M;
    int vals = 0; /* the 16-lane part's values from the registers */
    if (scale == 0.0f) {
        zero_codes(c, code, cbuf);
    } else {
        const __m512 one = _mm512_set1_ps(1.0f), hm = _mm512_set1_ps(c->hm);
        const __m512i top = _mm512_set1_epi32(M - 1), nanb = _mm512_set1_epi32(M), zero = _mm512_setzero_si512();
        for (e = 0; e < P16; e += 16) {
            const __m512 x = _mm512_div_ps(_mm512_loadu_ps(mbuf + e), vscale);
            _mm512_storeu_ps(mbuf + e, x);
            const __mmask16 isnan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
            __m512i b = _mm512_cvttps_epi32(_mm512_mul_ps(_mm512_add_ps(_mm512_maskz_mov_ps(~isnan, x), one), hm));
            b = _mm512_max_epi32(_mm512_min_epi32(b, top), zero);
            _mm512_storeu_si512(bbuf + e, _mm512_mask_mov_epi32(b, isnan, nanb));
        }
        bucket_tail(c, e, scale, mbuf, bbuf);
        vals = regs && M;
        lookup_codes(c, mbuf, bbuf, code, vals ? NULL : cbuf, P);
    }
    const __m512 ibc1 = _mm512_set1_ps(c->ibc1), vden = _mm512_set1_ps(den);
    const update16_scalars k = update16_scalars_of(&c->s);
    for (e = 0; e < P16; e += 16) {
        const __m512 value = _mm512_mul_ps(values16(&T, vals, code + e, cbuf + e), vscale);
        if (a->momentum_only) { /* the dequantised new momentum */
            _mm512_storeu_ps(a->m_out + off + e, value);
            continue;
        }
        PREFETCH(a->param, psz, off + e);
        const __m512 root = svc ? _mm512_mul_ps(vden, _mm512_loadu_ps(svc + e)) : vden;
        bounded_update16(a->param, a->param_dtype, off + e, _mm512_mul_ps(value, ibc1), root, &k, a->has_wd);
    }
    pass2_scalar(c, bi, e, scale, den, svc);
}

static AVX512 void block_avx512(const kctx *c, int64_t bi, const block_bufs *B, float den, const float *svc) {
    block16(c, bi, B, den, svc, 0);
}

static AVX512 void block_avx512_regs(const kctx *c, int64_t bi, const block_bufs *B, float den, const float *svc) {
    block16(c, bi, B, den, svc, 1);
}
#endif

static void one_block(const kctx *c, int64_t bi, const block_bufs *B, float den, const float *svc) {
#if GEFEN_X86
    if (c->isa == 2 && c->P >= 16) {
        if (c->P >= REGS_MIN) block_avx512_regs(c, bi, B, den, svc);
        else block_avx512(c, bi, B, den, svc);
        return;
    }
    if (c->isa && c->P >= 8) {
        block_avx2(c, bi, B, den, svc);
        return;
    }
#endif
    block_portable(c, bi, B, den, svc);
}

/* Blocks [b0, b1) of one thread: each block's denominator (the per-block path's comes from its
 * own pass 1), then the block. */
static void run_blocks(const kctx *c, int64_t b0, int64_t b1, const block_bufs *B) {
    const gefen_step_args *a = c->a;
    const int64_t P = c->P;
    for (int64_t bi = b0; bi < b1; ++bi) {
        if (a->factored) { /* sqrt(v_row / mean(v_row)) / sqrt(1 - b2^t), the block's columns */
            const int64_t r = bi / a->bpr;
            const float sa = sqrtf(a->v_row[r] / c->rm) * c->ib2s;
            one_block(c, bi, B, sa, c->svc + (bi - r * a->bpr) * P);
        } else {
            one_block(c, bi, B, 0.0f, NULL);
        }
    }
}

/* One Gefen step for one (rank-local) parameter; see gefen.functional.m8_update_.  With
 * momentum_only, just the momentum half (gefen.functional.update_momentum_): codes and scales
 * updated in place, the dequantised momentum written to m_out, nothing else touched.
 * Returns 0, -1 when out of memory (nothing modified), -2 on bad arguments (nothing modified). */
GEFEN_EXPORT int gefen_step(const gefen_step_args *a) {
    if (a->period < 1 || a->K < 2 || a->K > 256 || (a->lut_M && !a->lut) ||
        (a->momentum_only && ((!a->m_out && !a->scales_out) || a->factored)) || !a->mode)
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
    c.ibc1 = 1.0f / c.s.bc1;
    c.ib2s = 1.0f / c.s.b2s;
    c.rm = 0.0f;
    c.isa = call_isa(a->mode);
    c.svc = NULL;
    c.want_v = !a->factored && !a->momentum_only;
    memset(c.cb256, 0, sizeof c.cb256);
    memcpy(c.cb256, a->codebook, (size_t)a->K * sizeof(float));
    const int64_t numel = c.NB * c.P;
    const int nthreads = max_threads();
    const int par = numel >= PAR_MIN && nthreads > 1;
    (void)par;
    const int64_t stride = (c.P + 15) / 16 * 16 + 48; /* floats; odd multiple of 64 B apart (no 4K aliasing) */
    const int64_t svc_len = a->factored && !a->momentum_only ? c.cols : 0;
    float *bufs = (float *)malloc(((size_t)nthreads * (size_t)(3 * stride) + (size_t)svc_len) * sizeof(float));
    if (!bufs) return -1;
    if (svc_len) { /* finish the second moment (tiny) */
        float *svc = bufs + (size_t)nthreads * (size_t)(3 * stride);
        if (a->rows) memcpy(a->v_row, a->v_row_new, (size_t)a->rows * sizeof(float));
        const double R = (double)a->global_rows;
        for (int64_t j = 0; j < c.cols; ++j) {
            float cm = (float)(a->partials[j] / R);
            a->v_col[j] = fmaf(cm, c.s.o2, a->v_col[j] * c.s.b2);
            svc[j] = sqrtf(a->v_col[j]);
        }
        float rm = (float)(a->partials[c.cols] / R);
        c.rm = rm < FLT_MIN ? FLT_MIN : rm;
        c.svc = svc;
    }
    if (a->step_ptr && !a->momentum_only) *a->step_ptr = a->step;

#pragma omp parallel if (par)
    {
        int64_t b0, b1;
        thread_range(c.NB, &b0, &b1);
        float *mine = bufs + (size_t)thread_id() * (size_t)(3 * stride);
        block_bufs B = {mine, mine + stride, (int32_t *)(mine + 2 * stride)};
        run_blocks(&c, b0, b1, &B);
    }
    free(bufs);
    return 0;
}

GEFEN_EXPORT int gefen_native_abi(void) { return GEFEN_ABI; }
/* The OpenMP thread count of the calling thread's next kernels (gefen.c_kernels passes torch's, so
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
