/*
 * The fused CPU step of Gefen's "m4v4" state layout (4-bit first-moment code + 4-bit code of the
 * second moment's ratio to its factored estimate, both re-quantised with stochastic rounding),
 * bit-identical to the torch reference in gefen.functional.  Phase 1 (the float64 row and
 * column statistics) is gefen_m4v4_partials in gefen_step.c, which owns torch's summation order;
 * this file is phase 2 (decode, both moments, re-encode, the parameter update) and the exact
 * AdamW step of 1-D / 0-D tensors.  Part of gefen._gefen_step, loaded by gefen.native.
 *
 * Why parity holds without any calibration of its own: after phase 1 every value is a chain of
 * single IEEE fp32 operations (the file is compiled with -ffp-contract=off; the one fused
 * multiply-add is the final p + (-lr) * u, as torch's add(alpha=) computes it), lookups in
 * 16-entry tables, an exact max, uint32 hashing and torch's own square root (the call's mode).
 * The encode's clamp of p to [0, 1] is left out: u is in [0, 1), so `u < p` decides the same.
 * Each row is done by one thread, so any thread split gives the same bits.  Three row kernels
 * give identical results: AVX-512 (16 lanes; a 16-entry table is one register, the encode a
 * 4-step binary search of permutes), AVX2 (8 lanes, a table in two registers) and portable C;
 * the call's mode caps which runs (tests compare them).  The AVX-512 kernel halves
 * phase 2's time on the CPUs that have it (measured: 76 -> 33 ms per 8.4M elements, one thread).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gefen_common.h"

#define M4_PAR_MIN 32768 /* elements below which one thread does the tensor */
#define GUARD 1e-12f     /* smallest table spacing the encode divides by */

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

/* a sorted 16-entry table, its spacings d[lo] = max(t[lo + 1] - t[lo], GUARD) and curvatures
 * k[lo] (the second moment's; 0 for the first moment's, whose encode ignores them) */
typedef struct {
    float t[16], d[16], k[16];
} sr_table;

typedef struct {
    const m4v4_args *a;
    sr_table M, V;
    const float *v_col_old;
    hyper_f32 s;
    float mean_new, mean_old;
    uint32_t key_m, key_v; /* t * H_STEP + salt * H_SALT */
} m4ctx;

static void make_table(sr_table *T, const float *values, const float *kappa) {
    for (int k = 0; k < 16; ++k) {
        T->t[k] = values[k];
        T->k[k] = kappa ? kappa[k] : 0.0f;
    }
    for (int k = 0; k < 15; ++k) {
        float d = values[k + 1] - values[k];
        T->d[k] = d > GUARD ? d : GUARD;
    }
    T->d[15] = GUARD;
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

/* stochastic rounding of x to T: hi = clamp(#{t < x}, 1, 15) = 1 + #{k in 1..14 : t[k] < x} */
static inline int encode(const sr_table *T, float x, float u) {
    int hi = 1;
    for (int k = 1; k < 15; ++k) hi += T->t[k] < x;
    const int lo = hi - 1;
    const float p = (x - T->t[lo]) / T->d[lo];
    return lo + (u < p);
}

/* the second moment's rounding (gefen.stochastic.encode_v): p clamped to [0, 1] (NaN -> 0, the
 * same code as the reference's NaN p), then bent to p + K[lo] * (p * (1 - p)) */
static inline int encode_v(const sr_table *T, float x, float u) {
    int hi = 1;
    for (int k = 1; k < 15; ++k) hi += T->t[k] < x;
    const int lo = hi - 1;
    float p = (x - T->t[lo]) / T->d[lo];
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
 * Pass 1: both old moments decoded, v re-encoded (vq = vhat_new * R[code] kept in den for the
 * square root), m's EMA kept in mbuf with its max |m|.  Pass 2: the row scale, m re-encoded,
 * the update.  vc: the new second-moment codes. */
static void row_pass1_portable(const m4ctx *c, int64_t r, int64_t j0, float a_old, float a_new, float *den,
                               float *mbuf, uint8_t *vc, float *smax, int *nan) {
    const m4v4_args *a = c->a;
    const int64_t C = a->cols, off = r * C;
    const float s_old = bf16_to_f32(a->m_scale[r]);
    const uint32_t g0 = row_gidx(a, r);
    float most = *smax;
    int bad = 0;
    for (int64_t j = j0; j < C; ++j) {
        const uint8_t code = a->codes[off + j];
        const float g = ld_g(a->grad, a->grad_dtype, off + j);
        const float vh = a_new * a->v_col[j];
        float v = (a_old * c->v_col_old[j]) * c->V.t[code >> 4];
        v = v * c->s.b2 + (g * g) * c->s.o2;
        const int q = encode_v(&c->V, v / (vh > FLT_MIN ? vh : FLT_MIN), uniform(g0 + (uint32_t)j, c->key_v));
        vc[j] = (uint8_t)q;
        den[j] = vh * c->V.t[q];
        float m = c->M.t[code & 15] * s_old;
        m = m * c->s.b1 + g * c->s.o1;
        mbuf[j] = m;
        const float am = fabsf(m);
        bad |= am != am;
        most = am > most ? am : most;
    }
    *smax = most;
    *nan |= bad;
}

static void row_pass2_portable(const m4ctx *c, int64_t r, int64_t j0, float sf, const float *den, const float *mbuf,
                               const uint8_t *vc) {
    const m4v4_args *a = c->a;
    const int64_t C = a->cols, off = r * C;
    const float div = sf == 0.0f ? 1.0f : sf;
    const uint32_t g0 = row_gidx(a, r);
    for (int64_t j = j0; j < C; ++j) {
        const int q = encode(&c->M, mbuf[j] / div, uniform(g0 + (uint32_t)j, c->key_m));
        update_param(a->param, a->param_dtype, off + j, c->M.t[q] * sf / c->s.bc1, den[j] / c->s.b2s + c->s.eps, &c->s,
                     a->has_wd);
        a->codes[off + j] = (uint8_t)(q | (vc[j] << 4));
    }
}

#if GEFEN_X86
/* ----- one row, AVX2 (same roundings, 8 lanes) ---------------------------------------------- */
typedef struct {
    __m256 lo, hi, dlo, dhi, klo, khi;
} table8;

static AVX2 inline table8 table_regs(const sr_table *T) {
    table8 R = {_mm256_loadu_ps(T->t), _mm256_loadu_ps(T->t + 8), _mm256_loadu_ps(T->d),
                _mm256_loadu_ps(T->d + 8), _mm256_loadu_ps(T->k), _mm256_loadu_ps(T->k + 8)};
    return R;
}

/* lo8/hi8[idx], idx in 0..15 */
static AVX2 inline __m256 perm16(__m256 lo8, __m256 hi8, __m256i idx) {
    __m256 a = _mm256_permutevar8x32_ps(lo8, idx), b = _mm256_permutevar8x32_ps(hi8, idx);
    return _mm256_blendv_ps(a, b, _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
}

static AVX2 inline __m256 uniform8(__m256i gidx, __m256i key) {
    __m256i x = _mm256_add_epi32(_mm256_mullo_epi32(gidx, _mm256_set1_epi32((int)H_IDX)), key);
    x = _mm256_mullo_epi32(_mm256_xor_si256(x, _mm256_srli_epi32(x, 16)), _mm256_set1_epi32((int)H_MUL1));
    x = _mm256_mullo_epi32(_mm256_xor_si256(x, _mm256_srli_epi32(x, 15)), _mm256_set1_epi32((int)H_MUL2));
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(x, 8)), _mm256_set1_ps(0x1p-24f));
}

/* encode() on 8 lanes; returns the codes as int32 lanes */
static AVX2 inline __m256i encode8(const sr_table *T, const table8 *R, __m256 x, __m256 u) {
    __m256i hi = _mm256_set1_epi32(1);
    for (int k = 1; k < 15; ++k) /* mask lanes are -1: subtracting counts them */
        hi = _mm256_sub_epi32(hi, _mm256_castps_si256(_mm256_cmp_ps(_mm256_set1_ps(T->t[k]), x, _CMP_LT_OQ)));
    const __m256i lo = _mm256_sub_epi32(hi, _mm256_set1_epi32(1));
    const __m256 p = _mm256_div_ps(_mm256_sub_ps(x, perm16(R->lo, R->hi, lo)), perm16(R->dlo, R->dhi, lo));
    return _mm256_sub_epi32(lo, _mm256_castps_si256(_mm256_cmp_ps(u, p, _CMP_LT_OQ)));
}

/* encode_v() on 8 lanes (max_ps(p, 0) is 0 for a NaN p, as the portable kernel's) */
static AVX2 inline __m256i encode8_v(const sr_table *T, const table8 *R, __m256 x, __m256 u) {
    __m256i hi = _mm256_set1_epi32(1);
    for (int k = 1; k < 15; ++k)
        hi = _mm256_sub_epi32(hi, _mm256_castps_si256(_mm256_cmp_ps(_mm256_set1_ps(T->t[k]), x, _CMP_LT_OQ)));
    const __m256i lo = _mm256_sub_epi32(hi, _mm256_set1_epi32(1));
    const __m256 one = _mm256_set1_ps(1.0f);
    __m256 p = _mm256_div_ps(_mm256_sub_ps(x, perm16(R->lo, R->hi, lo)), perm16(R->dlo, R->dhi, lo));
    p = _mm256_min_ps(_mm256_max_ps(p, _mm256_setzero_ps()), one);
    p = _mm256_add_ps(p, _mm256_mul_ps(perm16(R->klo, R->khi, lo), _mm256_mul_ps(p, _mm256_sub_ps(one, p))));
    return _mm256_sub_epi32(lo, _mm256_castps_si256(_mm256_cmp_ps(u, p, _CMP_LT_OQ)));
}

static AVX2 inline __m256i lane_ids(uint32_t g) {
    return _mm256_add_epi32(_mm256_set1_epi32((int)g), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
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

static AVX2 float row_pass1_avx2(const m4ctx *c, int64_t r, float a_old, float a_new, float *den, float *mbuf,
                                 uint8_t *vc, int *nan) {
    const m4v4_args *a = c->a;
    const int64_t C = a->cols, off = r * C, C8 = C & ~(int64_t)7;
    const table8 V = table_regs(&c->V), M = table_regs(&c->M);
    const __m256 vs_old = _mm256_set1_ps(bf16_to_f32(a->m_scale[r])), vaold = _mm256_set1_ps(a_old);
    const __m256 vanew = _mm256_set1_ps(a_new), tiny = _mm256_set1_ps(FLT_MIN);
    const __m256 b1 = _mm256_set1_ps(c->s.b1), o1 = _mm256_set1_ps(c->s.o1), b2 = _mm256_set1_ps(c->s.b2);
    const __m256 o2 = _mm256_set1_ps(c->s.o2), absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const __m256i key = _mm256_set1_epi32((int)c->key_v), low4 = _mm256_set1_epi32(15);
    const uint32_t g0 = row_gidx(a, r);
    __m256 vmax = _mm256_setzero_ps(), vnan = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j < C8; j += 8) {
        const __m256i code = load_codes8(a->codes + off + j);
        const __m256 g = ld8_g(a->grad, a->grad_dtype, off + j);
        const __m256 vh = _mm256_mul_ps(vanew, _mm256_loadu_ps(a->v_col + j));
        __m256 v = _mm256_mul_ps(_mm256_mul_ps(vaold, _mm256_loadu_ps(c->v_col_old + j)),
                                 perm16(V.lo, V.hi, _mm256_srli_epi32(code, 4)));
        v = _mm256_add_ps(_mm256_mul_ps(v, b2), _mm256_mul_ps(_mm256_mul_ps(g, g), o2));
        /* max(vh, tiny) as the portable kernel's (vh > tiny ? vh : tiny): tiny for NaN */
        const __m256 ratio = _mm256_div_ps(v, _mm256_max_ps(vh, tiny));
        const __m256i q = encode8_v(&c->V, &V, ratio, uniform8(lane_ids(g0 + (uint32_t)j), key));
        store_bytes8(vc + j, q);
        _mm256_storeu_ps(den + j, _mm256_mul_ps(vh, perm16(V.lo, V.hi, q)));
        __m256 m = _mm256_mul_ps(perm16(M.lo, M.hi, _mm256_and_si256(code, low4)), vs_old);
        m = _mm256_add_ps(_mm256_mul_ps(m, b1), _mm256_mul_ps(g, o1));
        _mm256_storeu_ps(mbuf + j, m);
        const __m256 am = _mm256_and_ps(m, absmask);
        vnan = _mm256_or_ps(vnan, _mm256_cmp_ps(am, am, _CMP_UNORD_Q));
        vmax = _mm256_max_ps(vmax, am);
    }
    float smax = hmax8(vmax); /* lanes >= +0; a NaN lane sets nan, which discards smax */
    *nan |= _mm256_movemask_ps(vnan) != 0;
    row_pass1_portable(c, r, C8, a_old, a_new, den, mbuf, vc, &smax, nan);
    return smax;
}

static AVX2 void row_pass2_avx2(const m4ctx *c, int64_t r, float sf, const float *den, const float *mbuf,
                                const uint8_t *vc) {
    const m4v4_args *a = c->a;
    const int64_t C = a->cols, off = r * C, C8 = C & ~(int64_t)7;
    const table8 M = table_regs(&c->M);
    const __m256 vdiv = _mm256_set1_ps(sf == 0.0f ? 1.0f : sf), vsf = _mm256_set1_ps(sf);
    const __m256 bc1 = _mm256_set1_ps(c->s.bc1), b2s = _mm256_set1_ps(c->s.b2s), eps = _mm256_set1_ps(c->s.eps);
    const __m256 nlr = _mm256_set1_ps(c->s.nlr), decay = _mm256_set1_ps(c->s.decay);
    const __m256i key = _mm256_set1_epi32((int)c->key_m);
    const uint32_t g0 = row_gidx(a, r);
    for (int64_t j = 0; j < C8; j += 8) {
        const __m256i q = encode8(&c->M, &M, _mm256_div_ps(_mm256_loadu_ps(mbuf + j), vdiv),
                                  uniform8(lane_ids(g0 + (uint32_t)j), key));
        __m256 u = _mm256_div_ps(_mm256_mul_ps(perm16(M.lo, M.hi, q), vsf), bc1);
        u = _mm256_div_ps(u, _mm256_add_ps(_mm256_div_ps(_mm256_loadu_ps(den + j), b2s), eps));
        update_param8(a->param, a->param_dtype, off + j, u, nlr, decay, a->has_wd);
        const __m256i vq = load_codes8(vc + j);
        store_bytes8(a->codes + off + j, _mm256_or_si256(q, _mm256_slli_epi32(vq, 4)));
    }
    row_pass2_portable(c, r, C8, sf, den, mbuf, vc);
}

/* ----- one row, AVX-512 (same roundings, 16 lanes; a 16-entry table is one register) ------- */
#define AVX512 __attribute__((target("avx512f,avx2,fma")))

static AVX512 inline __m512 ld16_g(const void *g, int dt, int64_t i) {
    if (dt == DT_F32) return _mm512_loadu_ps((const float *)g + i);
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)g + i)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

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

static AVX512 inline __m512 uniform16(__m512i gidx, __m512i key) {
    __m512i x = _mm512_add_epi32(_mm512_mullo_epi32(gidx, _mm512_set1_epi32((int)H_IDX)), key);
    x = _mm512_mullo_epi32(_mm512_xor_si512(x, _mm512_srli_epi32(x, 16)), _mm512_set1_epi32((int)H_MUL1));
    x = _mm512_mullo_epi32(_mm512_xor_si512(x, _mm512_srli_epi32(x, 15)), _mm512_set1_epi32((int)H_MUL2));
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(x, 8)), _mm512_set1_ps(0x1p-24f));
}

/* encode() on 16 lanes: #{t[k] < x} capped at 15 by a 4-step branchless binary search (t is
 * sorted, so t[i + s - 1] < x means all of t[0 .. i + s) are), then hi = max(that, 1). */
static AVX512 inline __m512i encode16(__m512 T, __m512 D, __m512 x, __m512 u) {
    __m512i idx = _mm512_setzero_si512();
    for (int s = 8; s; s >>= 1) {
        __m512 t = _mm512_permutexvar_ps(_mm512_add_epi32(idx, _mm512_set1_epi32(s - 1)), T);
        idx = _mm512_mask_add_epi32(idx, _mm512_cmp_ps_mask(t, x, _CMP_LT_OQ), idx, _mm512_set1_epi32(s));
    }
    const __m512i one = _mm512_set1_epi32(1);
    const __m512i lo = _mm512_sub_epi32(_mm512_max_epi32(idx, one), one);
    const __m512 p = _mm512_div_ps(_mm512_sub_ps(x, _mm512_permutexvar_ps(lo, T)), _mm512_permutexvar_ps(lo, D));
    return _mm512_mask_add_epi32(lo, _mm512_cmp_ps_mask(u, p, _CMP_LT_OQ), lo, one);
}

/* encode_v() on 16 lanes: encode16's search, then the clamp (max_ps(p, 0) is 0 for a NaN p) and
 * the curvature K */
static AVX512 inline __m512i encode16_v(__m512 T, __m512 D, __m512 K, __m512 x, __m512 u) {
    __m512i idx = _mm512_setzero_si512();
    for (int s = 8; s; s >>= 1) {
        __m512 t = _mm512_permutexvar_ps(_mm512_add_epi32(idx, _mm512_set1_epi32(s - 1)), T);
        idx = _mm512_mask_add_epi32(idx, _mm512_cmp_ps_mask(t, x, _CMP_LT_OQ), idx, _mm512_set1_epi32(s));
    }
    const __m512i one = _mm512_set1_epi32(1);
    const __m512i lo = _mm512_sub_epi32(_mm512_max_epi32(idx, one), one);
    const __m512 fone = _mm512_set1_ps(1.0f);
    __m512 p = _mm512_div_ps(_mm512_sub_ps(x, _mm512_permutexvar_ps(lo, T)), _mm512_permutexvar_ps(lo, D));
    p = _mm512_min_ps(_mm512_max_ps(p, _mm512_setzero_ps()), fone);
    p = _mm512_add_ps(p, _mm512_mul_ps(_mm512_permutexvar_ps(lo, K), _mm512_mul_ps(p, _mm512_sub_ps(fone, p))));
    return _mm512_mask_add_epi32(lo, _mm512_cmp_ps_mask(u, p, _CMP_LT_OQ), lo, one);
}

static AVX512 inline __m512i lane_ids16(uint32_t g) {
    return _mm512_add_epi32(_mm512_set1_epi32((int)g),
                            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
}

static AVX512 float row_pass1_avx512(const m4ctx *c, int64_t r, float a_old, float a_new, float *den, float *mbuf,
                                     uint8_t *vc, int *nan) {
    const m4v4_args *a = c->a;
    const int64_t C = a->cols, off = r * C, C16 = C & ~(int64_t)15;
    const __m512 VT = _mm512_loadu_ps(c->V.t), VD = _mm512_loadu_ps(c->V.d), VK = _mm512_loadu_ps(c->V.k);
    const __m512 MT = _mm512_loadu_ps(c->M.t);
    const __m512 vs_old = _mm512_set1_ps(bf16_to_f32(a->m_scale[r])), vaold = _mm512_set1_ps(a_old);
    const __m512 vanew = _mm512_set1_ps(a_new), tiny = _mm512_set1_ps(FLT_MIN);
    const __m512 b1 = _mm512_set1_ps(c->s.b1), o1 = _mm512_set1_ps(c->s.o1), b2 = _mm512_set1_ps(c->s.b2);
    const __m512 o2 = _mm512_set1_ps(c->s.o2);
    const __m512i key = _mm512_set1_epi32((int)c->key_v), low4 = _mm512_set1_epi32(15);
    const __m512i absmask = _mm512_set1_epi32(0x7FFFFFFF);
    const uint32_t g0 = row_gidx(a, r);
    __m512 vmax = _mm512_setzero_ps();
    __mmask16 bad = 0;
    int64_t j = 0;
    for (; j < C16; j += 16) {
        const __m512i code = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(a->codes + off + j)));
        const __m512 g = ld16_g(a->grad, a->grad_dtype, off + j);
        const __m512 vh = _mm512_mul_ps(vanew, _mm512_loadu_ps(a->v_col + j));
        __m512 v = _mm512_mul_ps(_mm512_mul_ps(vaold, _mm512_loadu_ps(c->v_col_old + j)),
                                 _mm512_permutexvar_ps(_mm512_srli_epi32(code, 4), VT));
        v = _mm512_add_ps(_mm512_mul_ps(v, b2), _mm512_mul_ps(_mm512_mul_ps(g, g), o2));
        const __m512 ratio = _mm512_div_ps(v, _mm512_max_ps(vh, tiny));
        const __m512i q = encode16_v(VT, VD, VK, ratio, uniform16(lane_ids16(g0 + (uint32_t)j), key));
        _mm_storeu_si128((__m128i *)(vc + j), _mm512_cvtepi32_epi8(q));
        _mm512_storeu_ps(den + j, _mm512_mul_ps(vh, _mm512_permutexvar_ps(q, VT)));
        __m512 m = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_and_si512(code, low4), MT), vs_old);
        m = _mm512_add_ps(_mm512_mul_ps(m, b1), _mm512_mul_ps(g, o1));
        _mm512_storeu_ps(mbuf + j, m);
        const __m512 am = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(m), absmask));
        bad |= _mm512_cmp_ps_mask(am, am, _CMP_UNORD_Q);
        vmax = _mm512_max_ps(vmax, am);
    }
    float smax = _mm512_reduce_max_ps(vmax); /* exact: all lanes >= +0 */
    *nan |= bad != 0;
    row_pass1_portable(c, r, C16, a_old, a_new, den, mbuf, vc, &smax, nan);
    return smax;
}

static AVX512 void row_pass2_avx512(const m4ctx *c, int64_t r, float sf, const float *den, const float *mbuf,
                                    const uint8_t *vc) {
    const m4v4_args *a = c->a;
    const int64_t C = a->cols, off = r * C, C16 = C & ~(int64_t)15;
    const __m512 MT = _mm512_loadu_ps(c->M.t), MD = _mm512_loadu_ps(c->M.d);
    const __m512 vdiv = _mm512_set1_ps(sf == 0.0f ? 1.0f : sf), vsf = _mm512_set1_ps(sf);
    const __m512 bc1 = _mm512_set1_ps(c->s.bc1), b2s = _mm512_set1_ps(c->s.b2s), eps = _mm512_set1_ps(c->s.eps);
    const __m512 nlr = _mm512_set1_ps(c->s.nlr), decay = _mm512_set1_ps(c->s.decay);
    const __m512i key = _mm512_set1_epi32((int)c->key_m);
    const uint32_t g0 = row_gidx(a, r);
    for (int64_t j = 0; j < C16; j += 16) {
        const __m512i q = encode16(MT, MD, _mm512_div_ps(_mm512_loadu_ps(mbuf + j), vdiv),
                                   uniform16(lane_ids16(g0 + (uint32_t)j), key));
        __m512 u = _mm512_div_ps(_mm512_mul_ps(_mm512_permutexvar_ps(q, MT), vsf), bc1);
        u = _mm512_div_ps(u, _mm512_add_ps(_mm512_div_ps(_mm512_loadu_ps(den + j), b2s), eps));
        __m512 p = ld16_g(a->param, a->param_dtype, off + j);
        if (a->has_wd) p = _mm512_mul_ps(p, decay);
        st16_g(a->param, a->param_dtype, off + j, _mm512_fmadd_ps(u, nlr, p));
        const __m512i vq = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(vc + j)));
        _mm_storeu_si128((__m128i *)(a->codes + off + j), _mm512_cvtepi32_epi8(_mm512_or_si512(q, _mm512_slli_epi32(vq, 4))));
    }
    row_pass2_portable(c, r, C16, sf, den, mbuf, vc);
}
#endif

/* Row r: both passes, the square root between them, the row's new scale and v_row.  isa: the
 * kernels (call_isa: 2 AVX-512, 1 AVX2, 0 portable). */
static void one_row(const m4ctx *c, int64_t r, float *den, float *mbuf, uint8_t *vc, int isa) {
    const m4v4_args *a = c->a;
    const float a_old = a->v_row[r] / c->mean_old, a_new = a->v_row_new[r] / c->mean_new;
    int nan = 0;
    float smax = 0.0f;
#if GEFEN_X86
    if (isa == 2) smax = row_pass1_avx512(c, r, a_old, a_new, den, mbuf, vc, &nan);
    else if (isa == 1) smax = row_pass1_avx2(c, r, a_old, a_new, den, mbuf, vc, &nan);
    else
#endif
        row_pass1_portable(c, r, 0, a_old, a_new, den, mbuf, vc, &smax, &nan);
    mode_sqrt_n(a->mode, den, a->cols);
    const uint16_t sb = f32_to_bf16(a->row_max ? a->row_max[r] : nan ? NAN : smax);
    const float sf = bf16_to_f32(sb);
#if GEFEN_X86
    if (isa == 2) row_pass2_avx512(c, r, sf, den, mbuf, vc);
    else if (isa == 1) row_pass2_avx2(c, r, sf, den, mbuf, vc);
    else
#endif
        row_pass2_portable(c, r, 0, sf, den, mbuf, vc);
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
    float *bufs = (float *)malloc(((size_t)nthreads * (size_t)(3 * stride) + (size_t)stride) * sizeof(float));
    if (!bufs) return -1;
    m4ctx c;
    c.a = a;
    make_table(&c.M, a->codebook, NULL);
    make_table(&c.V, a->ratios, a->ratios + 16);
    float *v_col_old = bufs + (size_t)nthreads * (size_t)(3 * stride);
    memcpy(v_col_old, a->v_col, (size_t)C * sizeof(float));
    c.v_col_old = v_col_old;
    c.s = HYPER_F32(a);
    const double R = (double)a->global_rows;
    for (int64_t j = 0; j < C; ++j) a->v_col[j] = a->v_col[j] * c.s.b2 + (float)(a->partials[j] / R) * c.s.o2;
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
        float *den = bufs + (size_t)thread_id() * (size_t)(3 * stride), *mbuf = den + stride;
        uint8_t *vc = (uint8_t *)(mbuf + stride);
        const int mkl_prev = mode_threads_begin(a->mode);
        for (int64_t r = r0; r < r1; ++r) one_row(&c, r, den, mbuf, vc, isa);
        mode_threads_end(a->mode, mkl_prev);
    }
    free(bufs);
    return 0;
}

/* Phase 0 of a shard whose columns tensor parallelism splits: each local row's float64 sum of
 * g^2 (functional.row_square_sums) and max |m| of the new first moment (functional.row_abs_max of
 * m4v4_momentum; NaN when an m is NaN), the statistics reduced over tp before phases 1 and 2.
 * Nothing else is read or written.  The max is exact in any order, so the vector kernels (the
 * same m as pass 1's, lane by lane) give the portable loop's bits. */
static void row_max_portable(const void *g, int dt, const uint8_t *codes, const float *cb, int64_t off, int64_t j0,
                             int64_t C, float s_old, float b1, float o1, float *most, int *bad) {
    for (int64_t j = j0; j < C; ++j) {
        const float am = fabsf((cb[codes[off + j] & 15] * s_old) * b1 + ld_g(g, dt, off + j) * o1);
        *bad |= am != am;
        *most = am > *most ? am : *most;
    }
}

#if GEFEN_X86
static AVX2 int64_t row_max_avx2(const void *g, int dt, const uint8_t *codes, const float *cb, int64_t off, int64_t C,
                                 float s_old, float b1, float o1, float *most, int *bad) {
    const __m256 lo = _mm256_loadu_ps(cb), hi = _mm256_loadu_ps(cb + 8), vs = _mm256_set1_ps(s_old);
    const __m256 vb1 = _mm256_set1_ps(b1), vo1 = _mm256_set1_ps(o1);
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const __m256i low4 = _mm256_set1_epi32(15);
    __m256 vmax = _mm256_setzero_ps(), vnan = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= C; j += 8) {
        const __m256i code = _mm256_and_si256(load_codes8(codes + off + j), low4);
        __m256 m = _mm256_mul_ps(perm16(lo, hi, code), vs);
        m = _mm256_add_ps(_mm256_mul_ps(m, vb1), _mm256_mul_ps(ld8_g(g, dt, off + j), vo1));
        const __m256 am = _mm256_and_ps(m, absmask);
        vnan = _mm256_or_ps(vnan, _mm256_cmp_ps(am, am, _CMP_UNORD_Q));
        vmax = _mm256_max_ps(vmax, am);
    }
    *most = hmax8(vmax);
    *bad = _mm256_movemask_ps(vnan) != 0;
    return j;
}

static AVX512 int64_t row_max_avx512(const void *g, int dt, const uint8_t *codes, const float *cb, int64_t off,
                                     int64_t C, float s_old, float b1, float o1, float *most, int *bad) {
    const __m512 MT = _mm512_loadu_ps(cb), vs = _mm512_set1_ps(s_old), vb1 = _mm512_set1_ps(b1);
    const __m512 vo1 = _mm512_set1_ps(o1);
    const __m512i low4 = _mm512_set1_epi32(15), absmask = _mm512_set1_epi32(0x7FFFFFFF);
    __m512 vmax = _mm512_setzero_ps();
    __mmask16 nan = 0;
    int64_t j = 0;
    for (; j + 16 <= C; j += 16) {
        const __m512i code = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(codes + off + j)));
        __m512 m = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_and_si512(code, low4), MT), vs);
        m = _mm512_add_ps(_mm512_mul_ps(m, vb1), _mm512_mul_ps(ld16_g(g, dt, off + j), vo1));
        const __m512 am = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(m), absmask));
        nan |= _mm512_cmp_ps_mask(am, am, _CMP_UNORD_Q);
        vmax = _mm512_max_ps(vmax, am);
    }
    *most = _mm512_reduce_max_ps(vmax);
    *bad = nan != 0;
    return j;
}
#endif

GEFEN_EXPORT int gefen_m4v4_row_stats(const void *grad, int32_t gdt, const uint8_t *codes, const uint16_t *m_scale,
                                      const float *codebook, double beta1, double omb1, int64_t rows, int64_t cols,
                                      int32_t W, int32_t T, double *row_sum, float *row_max, const gefen_mode *mode) {
    if (rows < 0 || cols < 1 || (W != 8 && W != 16) || T < 1 || !mode) return -2;
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
        row_sum[r] = gefen_row_sq_sum(grad, gdt, r, rows, cols, W, T);
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
    mode_sqrt_n(a->mode, den, i1 - i0);
    for (int64_t i = i0; i < i1; ++i)
        update_param(a->param, a->param_dtype, i, mbuf[i - i0] / s.bc1, den[i - i0] / s.b2s + s.eps, &s, a->has_wd);
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
