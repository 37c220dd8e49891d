/*
 * The fused CPU step of Gefen's "m4v4" state layout (4-bit first-moment code + 4-bit code of the
 * second moment's ratio to its factored estimate, both re-quantised with stochastic rounding):
 * phase 1 (gefen_m4v4_partials: the float64 row and column statistics), phase 2
 * (gefen_m4v4_step: decode, both moments, re-encode, the parameter update), the column split's
 * row statistics and the AdamW step of 1-D / 0-D tensors.  Part of gefen._gefen_step, loaded by
 * gefen.c_kernels.
 *
 * The kernel contract (the same bits on every ISA, thread count and run; the reference's
 * arithmetic within a stated bound) is docs/design.md's "The m4v4 kernels".  Each row is done by
 * one thread.  The three row kernels: AVX-512 (16 lanes; a 16-entry table is one register, the
 * encode's search three compares and a 2-step binary search of permutes), AVX2 (8 lanes, a table
 * in two registers) and portable C; the call's mode caps which runs.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gefen_common.h"

#define M4_PAR_MIN 32768 /* elements below which one thread does the tensor */
#define GUARD 1e-12f     /* smallest table spacing the encode divides by */
#define IVH_MAX 0x1p126f /* 1 / FLT_MIN: the largest 1 / vhat (the reference clamps vhat to FLT_MIN) */

/* the counter hash (gefen.stochastic): x = gidx * H_IDX + t * H_STEP + salt * H_SALT, then mix */
#define H_IDX 0x9E3779B1u
#define H_STEP 0x85EBCA77u
#define H_SALT 0xC2B2AE3Du
#define H_MUL1 0x7FEB352Du
#define H_MUL2 0x846CA68Bu

typedef struct {
    GEFEN_ARGS_HEAD;
    uint8_t *codes;         /* mv_code [rows * cols]: first-moment code | second-moment code << 4 */
    uint16_t *m_scale;      /* m_row_scale, bf16 [rows] */
    float *v_row;           /* [rows]: the old v_row in, v_row_new out */
    const float *v_row_new; /* [rows]: phase 1's v_row' */
    float *v_col;           /* [cols]: EMA-updated here */
    const double *partials; /* [cols + 2]: globally reduced column sums, S_new, S_old */
    const float *codebook;  /* [16] first-moment codebook, sorted */
    const float *ratios;    /* [32] second-moment ratio table R (16, sorted), then curvatures K (16) */
    int64_t rows, cols, global_rows, global_cols, row_offset, col_offset;
    uint32_t salt_m, salt_v;
    const float *row_max; /* [rows] or NULL: each row's max |m| given (a column split's whole rows', reduced over tp) */
} m4v4_args;

/* a sorted 16-entry table, the reciprocals of its spacings inv[lo] = 1 / max(t[lo + 1] - t[lo],
 * GUARD) and curvatures k[lo] (the second moment's; 0 for the first moment's, whose encode ignores
 * them).  The reciprocals are fp32 divisions done once per call, so every kernel multiplies by
 * the same values.  s: the entries lower_code() compares, t[1 .. 14], then +inf twice (what a
 * 16-lane binary search needs to return lower_code() itself). */
typedef struct {
    float t[16], inv[16], k[16], s[16];
} sr_table;

typedef struct {
    const m4v4_args *a;
    sr_table M, V;
    const float *v_col_old;
    const float *svc, *ivc; /* sqrt(v_col') and 1 / v_col' per column */
    float sr[16];           /* sqrt(R[k]) */
    hyper_f32 s;
    float mean_new, mean_old, ib2s, ibc1; /* 1 / sqrt(1 - b2^t), 1 / (1 - b1^t) */
    uint32_t key_m, key_v;                /* t * H_STEP + salt * H_SALT */
} m4ctx;

/* Per row: the first-moment codebook times the old scale (the decode); 16 scalar fp32 products. */
typedef struct {
    float mold[16];
} row_tables;

static void make_table(sr_table *T, const float *values, const float *kappa) {
    for (int k = 0; k < 16; ++k) {
        T->t[k] = values[k];
        T->k[k] = kappa ? kappa[k] : 0.0f;
    }
    for (int k = 0; k < 15; ++k) {
        const float d = values[k + 1] - values[k], dg = d > GUARD ? d : GUARD;
        float inv = 1.0f / dg;
        /* rounded up until (t[k + 1] - t[k]) * inv >= 1: a value on an entry codes to it surely
         * (the first moment's exact 0 stays 0), as the reference's division gives p = 1 there */
        while (dg * inv < 1.0f) inv = nextafterf(inv, INFINITY);
        T->inv[k] = inv;
    }
    T->inv[15] = 1.0f / GUARD;
    for (int k = 0; k < 16; ++k) T->s[k] = k < 14 ? values[k + 1] : INFINITY;
}

static inline uint32_t mix(uint32_t x) {
    x = (x ^ (x >> 16)) * H_MUL1;
    x = (x ^ (x >> 15)) * H_MUL2;
    return x ^ (x >> 16);
}

/* uniform in [0, 1) for global flat index gidx (low 32 bits) */
static inline float uniform(uint32_t gidx, uint32_t key) {
    return (float)(mix(gidx * H_IDX + key) >> 8) * 0x1p-24f;
}

/* lo = clamp(#{t < x}, 1, 15) - 1 = #{k in 1..14 : t[k] < x} (NaN: 0) */
static inline int lower_code(const sr_table *T, float x) {
    int lo = 0;
    for (int k = 1; k < 15; ++k) lo += T->t[k] < x;
    return lo;
}

/* stochastic rounding of x to T: lo + (u < (x - t[lo]) * inv[lo]) */
static inline int encode(const sr_table *T, float x, float u) {
    const int lo = lower_code(T, x);
    const float p = (x - T->t[lo]) * T->inv[lo];
    return lo + (u < p);
}

/* the second moment's rounding: p clamped to [0, 1] (NaN -> 0), bent to p + K[lo] * (p * (1 - p)) */
static inline int encode_v(const sr_table *T, float x, float u) {
    const int lo = lower_code(T, x);
    float p = (x - T->t[lo]) * T->inv[lo];
    p = p > 0.0f ? p : 0.0f;
    p = p < 1.0f ? p : 1.0f;
    p = p + T->k[lo] * (p * (1.0f - p));
    return lo + (u < p);
}

/* the first global flat index of row r (rank-local), mod 2^32 */
static inline uint32_t row_gidx(const m4v4_args *a, int64_t r) {
    return (uint32_t)((uint64_t)(a->row_offset + r) * (uint64_t)a->global_cols + (uint64_t)a->col_offset);
}

/* ----- one row, portable --------------------------------------------------------------------
 * Pass 1: both old moments decoded, v re-encoded, the root of the update's second moment
 * w = sqrt(vhat_new * R[code]) * (1 / sqrt(1 - b2^t)) kept in wbuf, m's EMA kept in mbuf with its
 * max |m|.  Pass 2: m * (1 / row scale) re-encoded, m_hat = m * (1 / (1 - b1^t)) (the fp32 EMA, not
 * its code), p = p * (1 - lr wd) + (-lr) * (m_hat / bounded_den(w, m_hat)) (one fused multiply-add).
 * vc: the new second-moment codes, each shifted to its nibble (int32, so the vector kernels store
 * and load them without packing). */
static void row_pass1_portable(const m4ctx *c, const row_tables *rt, int64_t r, int64_t j0, float a_old, float ia,
                               float sa, float *wbuf, float *mbuf, int32_t *vc, float *smax, int *nan) {
    const m4v4_args *a = c->a;
    const int64_t C = a->cols, off = r * C;
    const uint32_t g0 = row_gidx(a, r);
    float most = *smax;
    int bad = 0;
    for (int64_t j = j0; j < C; ++j) {
        const uint8_t code = a->codes[off + j];
        const float g = ld_g(a->grad, a->grad_dtype, off + j);
        float v = (a_old * c->v_col_old[j]) * c->V.t[code >> 4];
        v = v * c->s.b2 + (g * g) * c->s.o2;
        float ivh = ia * c->ivc[j];
        ivh = ivh < IVH_MAX ? ivh : IVH_MAX;
        const int q = encode_v(&c->V, v * ivh, uniform(g0 + (uint32_t)j, c->key_v));
        vc[j] = q << 4;
        wbuf[j] = (sa * c->svc[j]) * c->sr[q];
        const float m = rt->mold[code & 15] * c->s.b1 + g * c->s.o1;
        mbuf[j] = m;
        fold_max_abs(m, &most, &bad);
    }
    *smax = most;
    *nan |= bad;
}

static void row_pass2_portable(const m4ctx *c, int64_t r, int64_t j0, float isf, const float *wbuf,
                               const float *mbuf, const int32_t *vc) {
    const m4v4_args *a = c->a;
    const int64_t C = a->cols, off = r * C;
    const uint32_t g0 = row_gidx(a, r);
    for (int64_t j = j0; j < C; ++j) {
        const int q = encode(&c->M, mbuf[j] * isf, uniform(g0 + (uint32_t)j, c->key_m));
        const float m_hat = mbuf[j] * c->ibc1;
        update_param(a->param, a->param_dtype, off + j, m_hat, bounded_den(wbuf[j], m_hat, c->s.ib, c->s.eps), &c->s,
                     a->has_wd);
        a->codes[off + j] = (uint8_t)(q | vc[j]);
    }
}

#if GEFEN_X86
/* ----- one row, AVX2 (same roundings, 8 lanes) ---------------------------------------------- */
typedef struct {
    __m256 lo, hi;
} table8;

static AVX2 inline table8 table_regs(const float *t) {
    table8 R = {_mm256_loadu_ps(t), _mm256_loadu_ps(t + 8)};
    return R;
}

/* R[idx], idx in 0..15 */
static AVX2 inline __m256 perm16(table8 R, __m256i idx) {
    __m256 a = _mm256_permutevar8x32_ps(R.lo, idx), b = _mm256_permutevar8x32_ps(R.hi, idx);
    return _mm256_blendv_ps(a, b, _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
}

/* the hash's first term gidx * H_IDX + key of 8 lanes from global index g: a loop then steps it
 * by 8 * H_IDX (mod 2^32 the same value), one add instead of a multiply per vector */
static AVX2 inline __m256i hash_start8(uint32_t g, uint32_t key) {
    const __m256i gidx = _mm256_add_epi32(_mm256_set1_epi32((int)g), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    return _mm256_add_epi32(_mm256_mullo_epi32(gidx, _mm256_set1_epi32((int)H_IDX)), _mm256_set1_epi32((int)key));
}

/* uniform() on 8 lanes of the hash's first term x */
static AVX2 inline __m256 uniform8(__m256i x) {
    x = _mm256_mullo_epi32(_mm256_xor_si256(x, _mm256_srli_epi32(x, 16)), _mm256_set1_epi32((int)H_MUL1));
    x = _mm256_mullo_epi32(_mm256_xor_si256(x, _mm256_srli_epi32(x, 15)), _mm256_set1_epi32((int)H_MUL2));
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(x, 8)), _mm256_set1_ps(0x1p-24f));
}

/* lower_code() on 8 lanes (mask lanes are -1: subtracting counts them) */
static AVX2 inline __m256i lower8(const sr_table *T, __m256 x) {
    __m256i lo = _mm256_setzero_si256();
    for (int k = 1; k < 15; ++k)
        lo = _mm256_sub_epi32(lo, _mm256_castps_si256(_mm256_cmp_ps(_mm256_set1_ps(T->t[k]), x, _CMP_LT_OQ)));
    return lo;
}

static AVX2 inline __m256i encode8(const sr_table *T, table8 Tt, table8 Ti, __m256 x, __m256 u) {
    const __m256i lo = lower8(T, x);
    const __m256 p = _mm256_mul_ps(_mm256_sub_ps(x, perm16(Tt, lo)), perm16(Ti, lo));
    return _mm256_sub_epi32(lo, _mm256_castps_si256(_mm256_cmp_ps(u, p, _CMP_LT_OQ)));
}

/* encode_v() on 8 lanes (max_ps(p, 0) is 0 for a NaN p, as the portable kernel's) */
static AVX2 inline __m256i encode8_v(const sr_table *T, table8 Tt, table8 Ti, table8 Tk, __m256 x, __m256 u) {
    const __m256i lo = lower8(T, x);
    const __m256 one = _mm256_set1_ps(1.0f);
    __m256 p = _mm256_mul_ps(_mm256_sub_ps(x, perm16(Tt, lo)), perm16(Ti, lo));
    p = _mm256_min_ps(_mm256_max_ps(p, _mm256_setzero_ps()), one);
    p = _mm256_add_ps(p, _mm256_mul_ps(perm16(Tk, lo), _mm256_mul_ps(p, _mm256_sub_ps(one, p))));
    return _mm256_sub_epi32(lo, _mm256_castps_si256(_mm256_cmp_ps(u, p, _CMP_LT_OQ)));
}

/* 8 codes (uint8) -> int32 lanes */
static AVX2 inline __m256i load_codes8(const uint8_t *p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
}

/* int32 lanes (each < 256) -> 8 bytes */
static AVX2 inline void store_bytes8(uint8_t *p, __m256i v) {
    __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    _mm_storel_epi64((__m128i *)p, _mm_packus_epi16(w, w));
}

static AVX2 float row_pass1_avx2(const m4ctx *c, const row_tables *rt, int64_t r, float a_old, float ia, float sa,
                                 float *wbuf, float *mbuf, int32_t *vc, int *nan) {
    const m4v4_args *a = c->a;
    const int64_t C = a->cols, off = r * C, C8 = C & ~(int64_t)7;
    const table8 VT = table_regs(c->V.t), VI = table_regs(c->V.inv), VK = table_regs(c->V.k);
    const table8 MO = table_regs(rt->mold), SR = table_regs(c->sr);
    const __m256 vaold = _mm256_set1_ps(a_old), via = _mm256_set1_ps(ia), vsa = _mm256_set1_ps(sa);
    const __m256 ivmax = _mm256_set1_ps(IVH_MAX);
    const __m256 b1 = _mm256_set1_ps(c->s.b1), o1 = _mm256_set1_ps(c->s.o1), b2 = _mm256_set1_ps(c->s.b2);
    const __m256 o2 = _mm256_set1_ps(c->s.o2);
    const __m256i low4 = _mm256_set1_epi32(15), hstep = _mm256_set1_epi32((int)(8u * H_IDX));
    __m256i hx = hash_start8(row_gidx(a, r), c->key_v);
    __m256i vmax = _mm256_setzero_si256(); /* max |m| as bits: see max_abs_bits */
    int64_t j = 0;
    const int gsz = DT_SIZE(a->grad_dtype);
    for (; j < C8; j += 8) {
        PREFETCH(a->grad, gsz, off + j);
        PREFETCH(a->codes, 1, off + j);
        const __m256i code = load_codes8(a->codes + off + j);
        const __m256 g = ld8_g(a->grad, a->grad_dtype, off + j);
        __m256 v = _mm256_mul_ps(_mm256_mul_ps(vaold, _mm256_loadu_ps(c->v_col_old + j)),
                                 perm16(VT, _mm256_srli_epi32(code, 4)));
        v = _mm256_add_ps(_mm256_mul_ps(v, b2), _mm256_mul_ps(_mm256_mul_ps(g, g), o2));
        /* min_ps(t, max) is max for a NaN t, as the portable kernel's (t < max ? t : max) */
        const __m256 ivh = _mm256_min_ps(_mm256_mul_ps(via, _mm256_loadu_ps(c->ivc + j)), ivmax);
        const __m256i q = encode8_v(&c->V, VT, VI, VK, _mm256_mul_ps(v, ivh), uniform8(hx));
        hx = _mm256_add_epi32(hx, hstep);
        _mm256_storeu_si256((__m256i *)(vc + j), _mm256_slli_epi32(q, 4));
        _mm256_storeu_ps(wbuf + j, _mm256_mul_ps(_mm256_mul_ps(vsa, _mm256_loadu_ps(c->svc + j)), perm16(SR, q)));
        __m256 m = perm16(MO, _mm256_and_si256(code, low4));
        m = _mm256_add_ps(_mm256_mul_ps(m, b1), _mm256_mul_ps(g, o1));
        _mm256_storeu_ps(mbuf + j, m);
        vmax = _mm256_max_epu32(vmax, abs_bits8(m));
    }
    float smax = max_abs_bits(hmax8_u32(vmax), nan);
    row_pass1_portable(c, rt, r, C8, a_old, ia, sa, wbuf, mbuf, vc, &smax, nan);
    return smax;
}

static AVX2 void row_pass2_avx2(const m4ctx *c, int64_t r, float isf, const float *wbuf, const float *mbuf,
                                const int32_t *vc) {
    const m4v4_args *a = c->a;
    const int64_t C = a->cols, off = r * C, C8 = C & ~(int64_t)7;
    const table8 MT = table_regs(c->M.t), MI = table_regs(c->M.inv);
    const __m256 visf = _mm256_set1_ps(isf), ibc1 = _mm256_set1_ps(c->ibc1);
    const update8_scalars k = update8_scalars_of(&c->s);
    const __m256i hstep = _mm256_set1_epi32((int)(8u * H_IDX));
    __m256i hx = hash_start8(row_gidx(a, r), c->key_m);
    const int psz = DT_SIZE(a->param_dtype);
    for (int64_t j = 0; j < C8; j += 8) {
        PREFETCH(a->param, psz, off + j);
        const __m256 m = _mm256_loadu_ps(mbuf + j);
        const __m256i q = encode8(&c->M, MT, MI, _mm256_mul_ps(m, visf), uniform8(hx));
        hx = _mm256_add_epi32(hx, hstep);
        bounded_update8(a->param, a->param_dtype, off + j, _mm256_mul_ps(m, ibc1), _mm256_loadu_ps(wbuf + j), &k,
                        a->has_wd);
        store_bytes8(a->codes + off + j, _mm256_or_si256(q, _mm256_loadu_si256((const __m256i *)(vc + j))));
    }
    row_pass2_portable(c, r, C8, isf, wbuf, mbuf, vc);
}

/* ----- one row, AVX-512 (same roundings, 16 lanes; a 16-entry table is one register) ------- */
static AVX512 inline __m512i hash_start16(uint32_t g, uint32_t key) {
    const __m512i gidx = _mm512_add_epi32(_mm512_set1_epi32((int)g),
                                          _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    return _mm512_add_epi32(_mm512_mullo_epi32(gidx, _mm512_set1_epi32((int)H_IDX)), _mm512_set1_epi32((int)key));
}

static AVX512 inline __m512 uniform16(__m512i x) {
    x = _mm512_mullo_epi32(_mm512_xor_si512(x, _mm512_srli_epi32(x, 16)), _mm512_set1_epi32((int)H_MUL1));
    x = _mm512_mullo_epi32(_mm512_xor_si512(x, _mm512_srli_epi32(x, 15)), _mm512_set1_epi32((int)H_MUL2));
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(x, 8)), _mm512_set1_ps(0x1p-24f));
}

/* lower_code() on 16 lanes: #{S[k] < x} for the search table S (sr_table.s: t[1 .. 14], +inf,
 * +inf; sorted, so S[i + s - 1] < x means all of S[0 .. i + s) are): three independent compares
 * with S[3], S[7], S[11] pick the group of four, a 2-step branchless binary search of permutes
 * the entry in it.  A NaN x compares false everywhere: 0. */
static AVX512 inline __m512i lower16(__m512 T, __m512 x) {
    const __m512i four = _mm512_set1_epi32(4);
    __m512i idx = _mm512_maskz_mov_epi32(
        _mm512_cmp_ps_mask(_mm512_permutexvar_ps(_mm512_set1_epi32(3), T), x, _CMP_LT_OQ), four);
    idx = _mm512_mask_add_epi32(idx, _mm512_cmp_ps_mask(_mm512_permutexvar_ps(_mm512_set1_epi32(7), T), x, _CMP_LT_OQ),
                                idx, four);
    idx = _mm512_mask_add_epi32(idx, _mm512_cmp_ps_mask(_mm512_permutexvar_ps(_mm512_set1_epi32(11), T), x, _CMP_LT_OQ),
                                idx, four);
    for (int s = 2; s; s >>= 1) {
        __m512 t = _mm512_permutexvar_ps(_mm512_add_epi32(idx, _mm512_set1_epi32(s - 1)), T);
        idx = _mm512_mask_add_epi32(idx, _mm512_cmp_ps_mask(t, x, _CMP_LT_OQ), idx, _mm512_set1_epi32(s));
    }
    return idx;
}

static AVX512 inline __m512i encode16(__m512 T, __m512 S, __m512 I, __m512 x, __m512 u) {
    const __m512i lo = lower16(S, x);
    const __m512 p = _mm512_mul_ps(_mm512_sub_ps(x, _mm512_permutexvar_ps(lo, T)), _mm512_permutexvar_ps(lo, I));
    return _mm512_mask_add_epi32(lo, _mm512_cmp_ps_mask(u, p, _CMP_LT_OQ), lo, _mm512_set1_epi32(1));
}

/* encode_v() on 16 lanes: the clamp (max_ps(p, 0) is 0 for a NaN p) and the curvature K */
static AVX512 inline __m512i encode16_v(__m512 T, __m512 S, __m512 I, __m512 K, __m512 x, __m512 u) {
    const __m512i lo = lower16(S, x);
    const __m512 fone = _mm512_set1_ps(1.0f);
    __m512 p = _mm512_mul_ps(_mm512_sub_ps(x, _mm512_permutexvar_ps(lo, T)), _mm512_permutexvar_ps(lo, I));
    p = _mm512_min_ps(_mm512_max_ps(p, _mm512_setzero_ps()), fone);
    p = _mm512_add_ps(p, _mm512_mul_ps(_mm512_permutexvar_ps(lo, K), _mm512_mul_ps(p, _mm512_sub_ps(fone, p))));
    return _mm512_mask_add_epi32(lo, _mm512_cmp_ps_mask(u, p, _CMP_LT_OQ), lo, _mm512_set1_epi32(1));
}

static AVX512 float row_pass1_avx512(const m4ctx *c, const row_tables *rt, int64_t r, float a_old, float ia,
                                     float sa, float *wbuf, float *mbuf, int32_t *vc, int *nan) {
    const m4v4_args *a = c->a;
    const int64_t C = a->cols, off = r * C, C16 = C & ~(int64_t)15;
    const __m512 VT = _mm512_loadu_ps(c->V.t), VS = _mm512_loadu_ps(c->V.s), VI = _mm512_loadu_ps(c->V.inv);
    const __m512 VK = _mm512_loadu_ps(c->V.k);
    const __m512 MO = _mm512_loadu_ps(rt->mold), SR = _mm512_loadu_ps(c->sr);
    const __m512 vaold = _mm512_set1_ps(a_old), via = _mm512_set1_ps(ia), vsa = _mm512_set1_ps(sa);
    const __m512 ivmax = _mm512_set1_ps(IVH_MAX);
    const __m512 b1 = _mm512_set1_ps(c->s.b1), o1 = _mm512_set1_ps(c->s.o1), b2 = _mm512_set1_ps(c->s.b2);
    const __m512 o2 = _mm512_set1_ps(c->s.o2);
    const __m512i low4 = _mm512_set1_epi32(15), hstep = _mm512_set1_epi32((int)(16u * H_IDX));
    __m512i hx = hash_start16(row_gidx(a, r), c->key_v);
    __m512i vmax = _mm512_setzero_si512(); /* max |m| as bits: see max_abs_bits */
    int64_t j = 0;
    const int gsz = DT_SIZE(a->grad_dtype);
    for (; j < C16; j += 16) {
        PREFETCH(a->grad, gsz, off + j);
        PREFETCH(a->codes, 1, off + j);
        const __m512i code = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(a->codes + off + j)));
        const __m512 g = ld16_g(a->grad, a->grad_dtype, off + j);
        __m512 v = _mm512_mul_ps(_mm512_mul_ps(vaold, _mm512_loadu_ps(c->v_col_old + j)),
                                 _mm512_permutexvar_ps(_mm512_srli_epi32(code, 4), VT));
        v = _mm512_add_ps(_mm512_mul_ps(v, b2), _mm512_mul_ps(_mm512_mul_ps(g, g), o2));
        const __m512 ivh = _mm512_min_ps(_mm512_mul_ps(via, _mm512_loadu_ps(c->ivc + j)), ivmax);
        const __m512i q = encode16_v(VT, VS, VI, VK, _mm512_mul_ps(v, ivh), uniform16(hx));
        hx = _mm512_add_epi32(hx, hstep);
        _mm512_storeu_si512(vc + j, _mm512_slli_epi32(q, 4));
        _mm512_storeu_ps(wbuf + j, _mm512_mul_ps(_mm512_mul_ps(vsa, _mm512_loadu_ps(c->svc + j)),
                                                 _mm512_permutexvar_ps(q, SR)));
        __m512 m = _mm512_permutexvar_ps(_mm512_and_si512(code, low4), MO);
        m = _mm512_add_ps(_mm512_mul_ps(m, b1), _mm512_mul_ps(g, o1));
        _mm512_storeu_ps(mbuf + j, m);
        vmax = _mm512_max_epu32(vmax, abs_bits16(m));
    }
    float smax = max_abs_bits(_mm512_reduce_max_epu32(vmax), nan);
    row_pass1_portable(c, rt, r, C16, a_old, ia, sa, wbuf, mbuf, vc, &smax, nan);
    return smax;
}

static AVX512 void row_pass2_avx512(const m4ctx *c, int64_t r, float isf, const float *wbuf, const float *mbuf,
                                    const int32_t *vc) {
    const m4v4_args *a = c->a;
    const int64_t C = a->cols, off = r * C, C16 = C & ~(int64_t)15;
    const __m512 MT = _mm512_loadu_ps(c->M.t), MS = _mm512_loadu_ps(c->M.s), MI = _mm512_loadu_ps(c->M.inv);
    const __m512 visf = _mm512_set1_ps(isf), ibc1 = _mm512_set1_ps(c->ibc1);
    const update16_scalars k = update16_scalars_of(&c->s);
    const __m512i hstep = _mm512_set1_epi32((int)(16u * H_IDX));
    __m512i hx = hash_start16(row_gidx(a, r), c->key_m);
    const int psz = DT_SIZE(a->param_dtype);
    for (int64_t j = 0; j < C16; j += 16) {
        PREFETCH(a->param, psz, off + j);
        const __m512 m = _mm512_loadu_ps(mbuf + j);
        const __m512i q = encode16(MT, MS, MI, _mm512_mul_ps(m, visf), uniform16(hx));
        hx = _mm512_add_epi32(hx, hstep);
        bounded_update16(a->param, a->param_dtype, off + j, _mm512_mul_ps(m, ibc1), _mm512_loadu_ps(wbuf + j), &k,
                         a->has_wd);
        _mm_storeu_si128((__m128i *)(a->codes + off + j), _mm512_cvtepi32_epi8(_mm512_or_si512(q, _mm512_loadu_si512(vc + j))));
    }
    row_pass2_portable(c, r, C16, isf, wbuf, mbuf, vc);
}
#endif

/* Row r: both passes, the row's new scale and v_row.  isa: the kernels (call_isa: 2 AVX-512,
 * 1 AVX2, 0 portable). */
static void one_row(const m4ctx *c, int64_t r, float *wbuf, float *mbuf, int32_t *vc, int isa) {
    const m4v4_args *a = c->a;
    const float a_old = a->v_row[r] / c->mean_old, a_new = a->v_row_new[r] / c->mean_new;
    const float ia = 1.0f / a_new, sa = sqrtf(a_new) * c->ib2s;
    const float s_old = bf16_to_f32(a->m_scale[r]);
    row_tables rt;
    for (int k = 0; k < 16; ++k) rt.mold[k] = c->M.t[k] * s_old;
    int nan = 0;
    float smax = 0.0f;
#if GEFEN_X86
    if (isa == 2) smax = row_pass1_avx512(c, &rt, r, a_old, ia, sa, wbuf, mbuf, vc, &nan);
    else if (isa == 1) smax = row_pass1_avx2(c, &rt, r, a_old, ia, sa, wbuf, mbuf, vc, &nan);
    else
#endif
        row_pass1_portable(c, &rt, r, 0, a_old, ia, sa, wbuf, mbuf, vc, &smax, &nan);
    const uint16_t sb = f32_to_bf16(a->row_max ? a->row_max[r] : nan ? NAN : smax);
    const float sf = bf16_to_f32(sb), isf = 1.0f / (sf == 0.0f ? 1.0f : sf);
#if GEFEN_X86
    if (isa == 2) row_pass2_avx512(c, r, isf, wbuf, mbuf, vc);
    else if (isa == 1) row_pass2_avx2(c, r, isf, wbuf, mbuf, vc);
    else
#endif
        row_pass2_portable(c, r, 0, isf, wbuf, mbuf, vc);
    (void)isa;
    a->m_scale[r] = sb;
    a->v_row[r] = a->v_row_new[r];
}

/* One m4v4 step of one (rank-local) >= 2-D parameter, viewed as [rows, cols].
 * Returns 0, -1 when out of memory (nothing modified), -2 on bad arguments (nothing modified). */
GEFEN_EXPORT int gefen_m4v4_step(const m4v4_args *a) {
    if (a->rows < 0 || a->cols < 1 || a->global_rows < 1 || a->global_cols < a->cols || a->row_offset < 0 ||
        a->col_offset < 0 || !a->mode)
        return -2;
    const int64_t C = a->cols, numel = a->rows * C;
    const int par = numel >= M4_PAR_MIN;
    const int nthreads = par ? max_threads() : 1;
    const int64_t stride = (C + 15) / 16 * 16 + 16; /* floats */
    float *bufs = (float *)malloc(((size_t)nthreads * (size_t)(3 * stride) + (size_t)(3 * stride)) * sizeof(float));
    if (!bufs) return -1;
    m4ctx c;
    c.a = a;
    make_table(&c.M, a->codebook, NULL);
    make_table(&c.V, a->ratios, a->ratios + 16);
    float *v_col_old = bufs + (size_t)nthreads * (size_t)(3 * stride);
    memcpy(v_col_old, a->v_col, (size_t)C * sizeof(float));
    c.v_col_old = v_col_old;
    c.s = HYPER_F32(a);
    c.ib2s = 1.0f / c.s.b2s;
    c.ibc1 = 1.0f / c.s.bc1;
    const double R = (double)a->global_rows;
    float *svc = v_col_old + stride, *ivc = svc + stride;
    for (int64_t j = 0; j < C; ++j) {
        const float vcn = a->v_col[j] * c.s.b2 + (float)(a->partials[j] / R) * c.s.o2;
        a->v_col[j] = vcn;
        svc[j] = sqrtf(vcn);
        ivc[j] = 1.0f / vcn;
    }
    c.svc = svc;
    c.ivc = ivc;
    for (int k = 0; k < 16; ++k) c.sr[k] = sqrtf(c.V.t[k]);
    const float mn = (float)(a->partials[C] / R), mo = (float)(a->partials[C + 1] / R);
    c.mean_new = mn > FLT_MIN ? mn : FLT_MIN;
    c.mean_old = mo > FLT_MIN ? mo : FLT_MIN;
    const uint32_t t = (uint32_t)a->step;
    c.key_m = t * H_STEP + a->salt_m * H_SALT;
    c.key_v = t * H_STEP + a->salt_v * H_SALT;
    if (a->step_ptr) *a->step_ptr = a->step;
    const int isa = call_isa(a->mode);
#pragma omp parallel num_threads(nthreads) if (par)
    {
        int64_t r0, r1;
        thread_range(a->rows, &r0, &r1);
        float *wbuf = bufs + (size_t)thread_id() * (size_t)(3 * stride), *mbuf = wbuf + stride;
        int32_t *vc = (int32_t *)(mbuf + stride);
        for (int64_t r = r0; r < r1; ++r) one_row(&c, r, wbuf, mbuf, vc, isa);
    }
    free(bufs);
    return 0;
}

/* ----- phase 1: the float64 row and column sums of g^2, in one fixed order ------------------
 * functional.m4v4_partials: v_row' = v_row * b2 + fp32(sum_j g^2 / row_len) * (1 - b2) and
 * partials = [sum_i g^2 per column..., sum(v_row'), sum(v_row)], every sum in float64 of the fp32
 * squares.  The order is fixed by the shape alone (not the thread count, not the ISA): a row's
 * sum has 16 lanes (lane l takes columns j = l mod 16 below the last multiple of 16), added
 * l = 0..15, then the remaining columns in order; a column's sum runs over fixed chunks of
 * P1_CHUNK(rows) rows, each summed top to bottom, the chunk sums then added in chunk order.
 * float64 sums of fp32 squares rounded once to fp32 rarely depend on the order at all. */
static inline int64_t p1_chunk(int64_t rows) {
    const int64_t c = (rows + 31) / 32;
    return c < 16 ? 16 : c;
}

/* row j0.. tail (and all of a row on the portable path): lanes[], tail, col[] */
static inline void p1_row_portable(const void *g, int dt, int64_t off, int64_t j0, int64_t C, double *lanes,
                                   double *tail, double *col) {
    const int64_t C16 = C & ~(int64_t)15;
    for (int64_t j = j0; j < C; ++j) {
        const float x = ld_g(g, dt, off + j);
        const double s = (double)(x * x);
        if (col) col[j] += s;
        if (j < C16) lanes[j & 15] += s;
        else *tail += s;
    }
}

#if GEFEN_X86
static AVX2 int64_t p1_row_avx2(const void *g, int dt, int64_t off, int64_t C, double *lanes, double *col) {
    __m256d l0 = _mm256_loadu_pd(lanes), l1 = _mm256_loadu_pd(lanes + 4), l2 = _mm256_loadu_pd(lanes + 8),
            l3 = _mm256_loadu_pd(lanes + 12);
    int64_t j = 0;
    const int gsz = DT_SIZE(dt);
    for (; j + 16 <= C; j += 16) {
        PREFETCH(g, gsz, off + j);
        const __m256 x0 = ld8_g(g, dt, off + j), x1 = ld8_g(g, dt, off + j + 8);
        const __m256 s0 = _mm256_mul_ps(x0, x0), s1 = _mm256_mul_ps(x1, x1);
        const __m256d d0 = _mm256_cvtps_pd(_mm256_castps256_ps128(s0)), d1 = _mm256_cvtps_pd(_mm256_extractf128_ps(s0, 1));
        const __m256d d2 = _mm256_cvtps_pd(_mm256_castps256_ps128(s1)), d3 = _mm256_cvtps_pd(_mm256_extractf128_ps(s1, 1));
        l0 = _mm256_add_pd(l0, d0);
        l1 = _mm256_add_pd(l1, d1);
        l2 = _mm256_add_pd(l2, d2);
        l3 = _mm256_add_pd(l3, d3);
        if (!col) continue;
        _mm256_storeu_pd(col + j, _mm256_add_pd(_mm256_loadu_pd(col + j), d0));
        _mm256_storeu_pd(col + j + 4, _mm256_add_pd(_mm256_loadu_pd(col + j + 4), d1));
        _mm256_storeu_pd(col + j + 8, _mm256_add_pd(_mm256_loadu_pd(col + j + 8), d2));
        _mm256_storeu_pd(col + j + 12, _mm256_add_pd(_mm256_loadu_pd(col + j + 12), d3));
    }
    _mm256_storeu_pd(lanes, l0);
    _mm256_storeu_pd(lanes + 4, l1);
    _mm256_storeu_pd(lanes + 8, l2);
    _mm256_storeu_pd(lanes + 12, l3);
    return j;
}

static AVX512 int64_t p1_row_avx512(const void *g, int dt, int64_t off, int64_t C, double *lanes, double *col) {
    __m512d l0 = _mm512_loadu_pd(lanes), l1 = _mm512_loadu_pd(lanes + 8);
    int64_t j = 0;
    const int gsz = DT_SIZE(dt);
    for (; j + 16 <= C; j += 16) {
        PREFETCH(g, gsz, off + j);
        const __m512 x = ld16_g(g, dt, off + j);
        const __m512 s = _mm512_mul_ps(x, x);
        const __m512d d0 = _mm512_cvtps_pd(_mm512_castps512_ps256(s));
        const __m512d d1 = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1)));
        l0 = _mm512_add_pd(l0, d0);
        l1 = _mm512_add_pd(l1, d1);
        if (!col) continue;
        _mm512_storeu_pd(col + j, _mm512_add_pd(_mm512_loadu_pd(col + j), d0));
        _mm512_storeu_pd(col + j + 8, _mm512_add_pd(_mm512_loadu_pd(col + j + 8), d1));
    }
    _mm512_storeu_pd(lanes, l0);
    _mm512_storeu_pd(lanes + 8, l1);
    return j;
}
#endif

/* row r's float64 sum of g^2; each square is also added into col[j] unless col is NULL (gefen_step.c's
 * block kernels sum a block of length P in the same order in their first pass) */
static double p1_row(const void *g, int dt, int64_t r, int64_t C, double *col, int isa) {
    double lanes[16] = {0}, tail = 0.0;
    const int64_t off = r * C;
    int64_t j = 0;
#if GEFEN_X86
    if (isa == 2) j = p1_row_avx512(g, dt, off, C, lanes, col);
    else if (isa == 1) j = p1_row_avx2(g, dt, off, C, lanes, col);
#endif
    (void)isa;
    p1_row_portable(g, dt, off, j, C, lanes, &tail, col);
    return lanes_total(lanes, tail);
}

GEFEN_EXPORT int gefen_m4v4_partials(const void *grad, int32_t gdt, int64_t rows, int64_t cols, const float *v_row_old,
                                     float *v_row_new, double *partials, double beta2, double omb2,
                                     const gefen_mode *mode, const double *row_sums, int64_t row_len) {
    if (cols < 1 || rows < 0 || !mode || row_len < 1) return -2;
    const float b2 = (float)beta2, o2 = (float)omb2;
    const int isa = call_isa(mode);
    const int64_t CH = p1_chunk(rows), nch = (rows + CH - 1) / CH;
    double *chunks = (double *)malloc((size_t)(nch > 0 ? nch : 1) * (size_t)cols * sizeof(double));
    if (!chunks) return -1;
    const int par = rows * cols >= M4_PAR_MIN;
    (void)par; /* read by the OpenMP pragma only */
    /* one parallel region: each thread zeroes and fills its chunks' column sums (while they are in
     * its cache), then, after the barrier, adds a range of columns over every chunk */
#pragma omp parallel if (par)
    {
        int64_t k0, k1, c0, c1;
        thread_range(nch, &k0, &k1);
        for (int64_t k = k0; k < k1; ++k) {
            double *col = chunks + (size_t)k * (size_t)cols;
            const int64_t r1 = (k + 1) * CH < rows ? (k + 1) * CH : rows;
            memset(col, 0, (size_t)cols * sizeof(double));
            for (int64_t r = k * CH; r < r1; ++r) {
                const double s = p1_row(grad, gdt, r, cols, col, isa);
                const double rs = row_sums ? row_sums[r] : s;
                v_row_new[r] = v_row_old[r] * b2 + (float)(rs / (double)row_len) * o2;
            }
        }
#pragma omp barrier
        thread_range(cols, &c0, &c1);
        for (int64_t j = c0; j < c1; ++j) partials[j] = 0.0;
        for (int64_t q = 0; q < nch; ++q) { /* chunk order, per column */
            const double *src = chunks + (size_t)q * (size_t)cols;
            for (int64_t j = c0; j < c1; ++j) partials[j] += src[j];
        }
    }
    free(chunks);
    double sn = 0.0, so = 0.0;
    for (int64_t r = 0; r < rows; ++r) {
        sn += (double)v_row_new[r];
        so += (double)v_row_old[r];
    }
    partials[cols] = sn;
    partials[cols + 1] = so;
    return 0;
}

/* Phase 0 of a shard whose columns tensor parallelism splits: each local row's float64 sum of
 * g^2 (functional.row_square_sums) and max |m| of the new first moment (functional.row_abs_max of
 * m4v4_momentum; NaN when an m is NaN), the statistics reduced over tp before phases 1 and 2.
 * Nothing else is read or written.  The max is exact in any order, so the vector kernels (the
 * same m as pass 1's, lane by lane) give the portable loop's bits. */
static void row_max_portable(const void *g, int dt, const uint8_t *codes, const float *cb, int64_t off, int64_t j0,
                             int64_t C, float s_old, float b1, float o1, float *most, int *bad) {
    for (int64_t j = j0; j < C; ++j)
        fold_max_abs((cb[codes[off + j] & 15] * s_old) * b1 + ld_g(g, dt, off + j) * o1, most, bad);
}

#if GEFEN_X86
static AVX2 int64_t row_max_avx2(const void *g, int dt, const uint8_t *codes, const float *cb, int64_t off, int64_t C,
                                 float s_old, float b1, float o1, float *most, int *bad) {
    const table8 CB = table_regs(cb);
    const __m256 vs = _mm256_set1_ps(s_old);
    const __m256 vb1 = _mm256_set1_ps(b1), vo1 = _mm256_set1_ps(o1);
    const __m256i low4 = _mm256_set1_epi32(15);
    __m256i vmax = _mm256_setzero_si256(); /* max |m| as bits */
    int64_t j = 0;
    for (; j + 8 <= C; j += 8) {
        const __m256i code = _mm256_and_si256(load_codes8(codes + off + j), low4);
        __m256 m = _mm256_mul_ps(perm16(CB, code), vs);
        m = _mm256_add_ps(_mm256_mul_ps(m, vb1), _mm256_mul_ps(ld8_g(g, dt, off + j), vo1));
        vmax = _mm256_max_epu32(vmax, abs_bits8(m));
    }
    *most = max_abs_bits(hmax8_u32(vmax), bad);
    return j;
}

static AVX512 int64_t row_max_avx512(const void *g, int dt, const uint8_t *codes, const float *cb, int64_t off,
                                     int64_t C, float s_old, float b1, float o1, float *most, int *bad) {
    const __m512 MT = _mm512_loadu_ps(cb), vs = _mm512_set1_ps(s_old), vb1 = _mm512_set1_ps(b1);
    const __m512 vo1 = _mm512_set1_ps(o1);
    const __m512i low4 = _mm512_set1_epi32(15);
    __m512i vmax = _mm512_setzero_si512(); /* max |m| as bits */
    int64_t j = 0;
    for (; j + 16 <= C; j += 16) {
        const __m512i code = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(codes + off + j)));
        __m512 m = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_and_si512(code, low4), MT), vs);
        m = _mm512_add_ps(_mm512_mul_ps(m, vb1), _mm512_mul_ps(ld16_g(g, dt, off + j), vo1));
        vmax = _mm512_max_epu32(vmax, abs_bits16(m));
    }
    *most = max_abs_bits(_mm512_reduce_max_epu32(vmax), bad);
    return j;
}
#endif

GEFEN_EXPORT int gefen_m4v4_row_stats(const void *grad, int32_t gdt, const uint8_t *codes, const uint16_t *m_scale,
                                      const float *codebook, double beta1, double omb1, int64_t rows, int64_t cols,
                                      double *row_sum, float *row_max, const gefen_mode *mode) {
    if (rows < 0 || cols < 1 || !mode) return -2;
    const float b1 = (float)beta1, o1 = (float)omb1;
    const int isa = call_isa(mode);
    int64_t r = 0;
#pragma omp parallel for schedule(static) if (rows > 1 && rows * cols >= M4_PAR_MIN)
    for (r = 0; r < rows; ++r) {
        const int64_t off = r * cols;
        const float s_old = bf16_to_f32(m_scale[r]);
        float most = 0.0f;
        int bad = 0;
        int64_t j = 0;
#if GEFEN_X86
        if (isa == 2) j = row_max_avx512(grad, gdt, codes, codebook, off, cols, s_old, b1, o1, &most, &bad);
        else if (isa == 1) j = row_max_avx2(grad, gdt, codes, codebook, off, cols, s_old, b1, o1, &most, &bad);
#endif
        (void)isa;
        row_max_portable(grad, gdt, codes, codebook, off, j, cols, s_old, b1, o1, &most, &bad);
        row_max[r] = bad ? NAN : most;
        row_sum[r] = p1_row(grad, gdt, r, cols, NULL, isa);
    }
    return 0;
}

/* ----- 1-D / 0-D tensors: AdamW with the same op discipline, exp_avg in bf16 -------------------- */
typedef struct {
    GEFEN_ARGS_HEAD;
    uint16_t *exp_avg; /* bf16, stochastically rounded (round_bf16) */
    float *exp_avg_sq;
    int64_t n, row_offset;
    uint32_t salt;
} adamw_args;

#define ADAMW_CHUNK 4096

/* gefen.stochastic.round_bf16: the hash's top 16 bits added below the bf16 mantissa, then dropped */
static inline uint16_t round_bf16(float x, uint32_t bits) {
    if (x != x) return f32_to_bf16(x);
    uint32_t b;
    memcpy(&b, &x, sizeof b);
    return (uint16_t)((b + (bits >> 16)) >> 16);
}

static void adamw_chunk(const adamw_args *a, int64_t i0, int64_t i1, float *den, float *mbuf) {
    const hyper_f32 s = HYPER_F32(a);
    const uint32_t key = (uint32_t)a->step * H_STEP + a->salt * H_SALT;
    for (int64_t i = i0; i < i1; ++i) {
        const float g = ld_g(a->grad, a->grad_dtype, i);
        const float m = bf16_to_f32(a->exp_avg[i]) * s.b1 + g * s.o1;
        mbuf[i - i0] = m;
        a->exp_avg[i] = round_bf16(m, mix((uint32_t)(a->row_offset + i) * H_IDX + key));
        const float v = a->exp_avg_sq[i] * s.b2 + (g * g) * s.o2;
        a->exp_avg_sq[i] = v;
        den[i - i0] = v;
    }
    mode_sqrt_n(a->mode, den, (int)(i1 - i0));
    for (int64_t i = i0; i < i1; ++i) {
        const float m_hat = mbuf[i - i0] / s.bc1;
        update_param(a->param, a->param_dtype, i, m_hat, bounded_den(den[i - i0] / s.b2s, m_hat, s.ib, s.eps), &s,
                     a->has_wd);
    }
}

GEFEN_EXPORT int gefen_adamw_step(const adamw_args *a) {
    if (a->n < 0 || !a->mode) return -2;
    const int64_t nchunks = (a->n + ADAMW_CHUNK - 1) / ADAMW_CHUNK;
    int64_t k = 0;
#pragma omp parallel for schedule(static) if (a->n >= M4_PAR_MIN)
    for (k = 0; k < nchunks; ++k) {
        float den[ADAMW_CHUNK], mbuf[ADAMW_CHUNK];
        const int mkl_prev = mode_threads_begin(a->mode);
        const int64_t i0 = k * ADAMW_CHUNK, i1 = i0 + ADAMW_CHUNK < a->n ? i0 + ADAMW_CHUNK : a->n;
        adamw_chunk(a, i0, i1, den, mbuf);
        mode_threads_end(a->mode, mkl_prev);
    }
    if (a->step_ptr) *a->step_ptr = a->step;
    return 0;
}

/* ----- bf16_stochastic_round: a parameter's fp32 update written back into bf16 ---------------- */
/* dst[k] = round_bf16(src[k], hash(global index of k, key)) for the [rows, cols] view of a shard
 * whose element (r, j) is global flat index (row_offset + r) * global_cols + col_offset + j;
 * key = t * H_STEP + salt * H_SALT (gefen.stochastic.hash_base).  Returns 0, -2 on bad arguments. */
GEFEN_EXPORT int gefen_round_bf16(const float *src, uint16_t *dst, int64_t rows, int64_t cols, int64_t row_offset,
                                  int64_t global_cols, int64_t col_offset, uint32_t key) {
    if (rows < 0 || cols < 0 || row_offset < 0 || col_offset < 0 || global_cols < 0) return -2;
    int64_t r = 0;
#pragma omp parallel for schedule(static) if (rows * cols >= M4_PAR_MIN)
    for (r = 0; r < rows; ++r) {
        const uint32_t g0 = (uint32_t)((uint64_t)(row_offset + r) * (uint64_t)global_cols + (uint64_t)col_offset);
        const float *s = src + r * cols;
        uint16_t *d = dst + r * cols;
        for (int64_t j = 0; j < cols; ++j) d[j] = round_bf16(s[j], mix((g0 + (uint32_t)j) * H_IDX + key));
    }
    return 0;
}
