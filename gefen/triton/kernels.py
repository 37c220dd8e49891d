"""The Triton kernels (imported only by ``gefen.triton.launch``, so Triton is optional).

Every kernel walks a *table* of parameters so that one launch serves a whole group of them:
``progs`` is int64 ``[n_programs, 2]`` (parameter index, first row of the program's tile),
``ptrs`` is int64 ``[n_params, N]`` (data pointers of the parameter's tensors, cast to typed
pointers in the kernel) and ``meta`` holds each parameter's sizes and per-step scalars.  A
program owns ``BR`` whole rows; a row is processed in one tile when ``SINGLE`` (it fits in
``BC`` columns, kept in registers) and otherwise in two passes over column tiles (the first
finds the row's max-abs, the second recomputes the same values and writes).

Arithmetic follows the eager references op for op (one IEEE op each; launch with
``enable_fp_fusion=False`` so a GPU build does not contract them into FMAs); ``tl.fma`` appears
only where the eager op itself is an FMA (torch's ``lerp`` and ``add(alpha=)``). fp32 divisions
are ``tl.div_rn`` and square roots ``tl.sqrt_rn``: Triton's ``/`` and ``tl.sqrt`` compile to
approximate instructions on NVIDIA (``div.full.f32``, ``sqrt.approx``).
"""

from __future__ import annotations

try:  # Triton is optional (the gpu and test extras); gefen.triton.dispatch reports its absence
    import triton
    import triton.language as tl
except ImportError as exc:
    raise ImportError("gefen's GPU kernels need Triton: pip install 'gefen[gpu]'") from exc

# module constants a kernel reads must be tl.constexpr (a compiled kernel refuses plain globals)
TINY = tl.constexpr(1.1754943508222875e-38)  # torch.finfo(torch.float32).tiny
GUARD = tl.constexpr(1e-12)  # fp32(1e-12) once cast (the spec's GUARD)
INV_2_24 = tl.constexpr(5.960464477539063e-08)  # 2**-24


@triton.jit
def _ptr(table, col: tl.constexpr, width: tl.constexpr, pidx, dtype: tl.constexpr):
    return tl.load(table + pidx * width + col).to(tl.pointer_type(dtype))


@triton.jit
def _to_bf16(x):
    """fp32 -> bfloat16, round to nearest even, done on the bits: Triton's interpreter truncates
    in ``.to(tl.bfloat16)``, so the rounding is spelled out (the value is then exact in bf16)."""
    b = x.to(tl.uint32, bitcast=True)
    b = (b + (0x7FFF + ((b >> 16) & 1))) & 0xFFFF0000
    return b.to(tl.float32, bitcast=True).to(tl.bfloat16)


@triton.jit
def _store_as(ptr, x, mask, DT: tl.constexpr):
    """Store fp32 ``x`` as ``DT`` (fp32 or bf16, the latter rounded to nearest even)."""
    if DT == tl.bfloat16:
        tl.store(ptr, _to_bf16(x), mask=mask)
    else:
        tl.store(ptr, x, mask=mask)


@triton.jit
def _count_below(x, table, LOG2K: tl.constexpr):
    """Number of entries of the sorted, +inf-padded ``table`` (2**LOG2K entries) strictly below
    ``x``, capped at 2**LOG2K - 1 (a branch-free binary search)."""
    pos = tl.zeros(x.shape, dtype=tl.int32)
    for k in tl.static_range(LOG2K):
        step = 1 << (LOG2K - 1 - k)
        t = tl.load(table + pos + (step - 1))
        pos = tl.where(t < x, pos + step, pos)
    return pos


@triton.jit
def _hash_bits(gidx, base):
    """The spec's counter hash: ``gidx`` int64 (low 32 bits used), ``base`` uint32 =
    (t * 0x85EBCA77 + salt * 0xC2B2AE3D) mod 2**32 precomputed per parameter; uint32."""
    x = gidx.to(tl.uint32) * tl.full([], 0x9E3779B1, tl.uint32) + base
    x = (x ^ (x >> 16)) * tl.full([], 0x7FEB352D, tl.uint32)
    x = (x ^ (x >> 15)) * tl.full([], 0x846CA68B, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def _hash_uniform(gidx, base):
    """Uniform fp32 in [0, 1): the hash's top 24 bits."""
    return (_hash_bits(gidx, base) >> 8).to(tl.float32) * INV_2_24


@triton.jit
def _round_bf16(x, bits):
    """gefen.stochastic.round_bf16: the hash's top 16 bits added below the bf16 mantissa, then
    dropped (NaN stays NaN); returned as the bf16 value."""
    b = (x.to(tl.uint32, bitcast=True) + (bits >> 16)) & 0xFFFF0000
    out = b.to(tl.float32, bitcast=True)
    return tl.where(x != x, x, out).to(tl.bfloat16)


@triton.jit
def _encode(x, table, u):
    """Stochastic rounding of ``x`` to the sorted 16-entry ``table`` (the spec's encode)."""
    hi = _count_below(x, table, 4)
    hi = tl.minimum(tl.maximum(hi, 1), 15)
    lo = hi - 1
    t_lo = tl.load(table + lo)
    t_hi = tl.load(table + hi)
    p = tl.div_rn(x - t_lo, tl.maximum(t_hi - t_lo, GUARD))
    p = tl.minimum(tl.maximum(p, 0.0), 1.0)
    return tl.where(u < p, hi, lo)


# ----- GefenMuon's compressed momentum (8-bit codes, per-block max-abs, nearest code) ---------------
@triton.jit
def _momentum_and_grad(grad_p, codes_p, cb, off, mask, scale, w, small):
    """The new first moment ``lerp(cb[code] * scale, g, w)`` (fp32) and the fp32 gradient."""
    code = tl.load(codes_p + off, mask=mask, other=0).to(tl.int32)
    m = tl.load(cb + code) * scale[:, None]
    g = tl.load(grad_p + off, mask=mask, other=0.0).to(tl.float32)
    # torch's lerp: w < 0.5 ? fma(w, g - m, m) : fma(w - 1, g - m, g)
    coef = tl.where(small, w, w - 1.0)
    return tl.fma(coef, g - m, tl.where(small, m, g)), g


@triton.jit
def _momentum_tile(grad_p, codes_p, cb, off, mask, scale, w, small):
    m, _ = _momentum_and_grad(grad_p, codes_p, cb, off, mask, scale, w, small)
    return m


@triton.jit
def _requantise(m, s, cb, thr, K, LOG2K: tl.constexpr):
    """Nearest codes (int32) of ``m`` in blocks of max-abs ``s`` and the decoded ``cb[code] * s``."""
    zero = s == 0.0
    x = tl.div_rn(m, tl.where(zero, 1.0, s)[:, None])
    code = _count_below(x, thr, LOG2K)
    code = tl.where(x != x, K - 1, code)  # NaN -> the last code, as torch.searchsorted
    code = tl.where(zero[:, None], 0, code)
    return code, tl.load(cb + code) * s[:, None]


@triton.jit
def _momentum_store(m, s, off, mask, codes_p, out_p, cb, thr, K, LOG2K: tl.constexpr):
    code, mq = _requantise(m, s, cb, thr, K, LOG2K)
    tl.store(codes_p + off, code.to(tl.uint8), mask=mask)
    tl.store(out_p + off, mq, mask=mask)


@triton.jit
def momentum_kernel(progs, ptrs, sizes, weights, cb, thr, K, LOG2K: tl.constexpr, BR: tl.constexpr,
                    BC: tl.constexpr, SINGLE: tl.constexpr, GRAD_T: tl.constexpr):
    """``functional.update_momentum_`` for a table of parameters viewed as ``[blocks, P]``:
    ptrs = (grad, codes, scales, out), sizes = (blocks, P), weights = fp32 lerp weight."""
    pid = tl.program_id(0)
    pidx = tl.load(progs + 2 * pid)
    r0 = tl.load(progs + 2 * pid + 1)
    grad_p = _ptr(ptrs, 0, 4, pidx, GRAD_T)
    codes_p = _ptr(ptrs, 1, 4, pidx, tl.uint8)
    scales_p = _ptr(ptrs, 2, 4, pidx, tl.float32)
    out_p = _ptr(ptrs, 3, 4, pidx, tl.float32)
    nb = tl.load(sizes + 2 * pidx)
    P = tl.load(sizes + 2 * pidx + 1)
    w = tl.load(weights + pidx)
    small = w < 0.5
    rows = r0 + tl.arange(0, BR).to(tl.int64)
    rmask = rows < nb
    cols = tl.arange(0, BC).to(tl.int64)
    scale = tl.load(scales_p + rows, mask=rmask, other=0.0)
    if SINGLE:
        off = rows[:, None] * P + cols[None, :]
        mask = rmask[:, None] & (cols < P)[None, :]
        m = _momentum_tile(grad_p, codes_p, cb, off, mask, scale, w, small)
        s = tl.max(tl.where(mask, tl.abs(m), 0.0), axis=1)
        _momentum_store(m, s, off, mask, codes_p, out_p, cb, thr, K, LOG2K)
    else:
        s = tl.zeros([BR], dtype=tl.float32)
        for c0 in range(0, P, BC):
            c = c0 + cols
            off = rows[:, None] * P + c[None, :]
            mask = rmask[:, None] & (c < P)[None, :]
            m = _momentum_tile(grad_p, codes_p, cb, off, mask, scale, w, small)
            s = tl.maximum(s, tl.max(tl.where(mask, tl.abs(m), 0.0), axis=1))
        for c0 in range(0, P, BC):
            c = c0 + cols
            off = rows[:, None] * P + c[None, :]
            mask = rmask[:, None] & (c < P)[None, :]
            m = _momentum_tile(grad_p, codes_p, cb, off, mask, scale, w, small)
            _momentum_store(m, s, off, mask, codes_p, out_p, cb, thr, K, LOG2K)
    tl.store(scales_p + rows, s, mask=rmask)


# ----- Gefen m4v4: matrices (>= 2-D, one row = one block) --------------------------------------
# scalar table columns (fp32, one row per parameter)
S_B1, S_OMB1, S_B2, S_OMB2, S_BIAS1, S_BIAS2, S_EPS, S_NEG_LR, S_DECAY, S_MEAN_NEW, S_MEAN_OLD = map(tl.constexpr, range(11))
N_SCALARS = tl.constexpr(11)
# int table columns (int64): local rows, row length C, global row of local row 0, hash bases, weight decay
# flag, global rows (>= 1), global row length
I_ROWS, I_C, I_ROW0, I_BASE_M, I_BASE_V, I_HAS_WD, I_GROWS, I_ROW_LEN = map(tl.constexpr, range(8))
N_INTS = tl.constexpr(8)


@triton.jit
def m4v4_prologue_kernel(progs, ptrs, ints, scal, BC: tl.constexpr):
    """``v_col' = v_col * b2 + fp32(col_sum / rows) * (1 - b2)`` into a scratch column buffer, and
    the two row means ``max(fp32(S / rows), TINY)`` into the scalar table (program of column 0).
    ptrs = (v_col, v_col_new, partials[f64: col_sum..., S_new, S_old])."""
    pid = tl.program_id(0)
    pidx = tl.load(progs + 2 * pid)
    c0 = tl.load(progs + 2 * pid + 1)
    v_col = _ptr(ptrs, 0, 3, pidx, tl.float32)
    v_new = _ptr(ptrs, 1, 3, pidx, tl.float32)
    parts = _ptr(ptrs, 2, 3, pidx, tl.float64)
    C = tl.load(ints + pidx * N_INTS + I_C)
    grows = tl.load(ints + pidx * N_INTS + I_GROWS).to(tl.float64)
    b2 = tl.load(scal + pidx * N_SCALARS + S_B2)
    omb2 = tl.load(scal + pidx * N_SCALARS + S_OMB2)
    c = c0 + tl.arange(0, BC).to(tl.int64)
    mask = c < C
    col_mean = (tl.load(parts + c, mask=mask, other=0.0) / grows).to(tl.float32)
    tl.store(v_new + c, tl.load(v_col + c, mask=mask, other=0.0) * b2 + col_mean * omb2, mask=mask)
    if c0 == 0:
        s_new = (tl.load(parts + C) / grows).to(tl.float32)
        s_old = (tl.load(parts + C + 1) / grows).to(tl.float32)
        tl.store(scal + pidx * N_SCALARS + S_MEAN_NEW, tl.maximum(s_new, TINY))
        tl.store(scal + pidx * N_SCALARS + S_MEAN_OLD, tl.maximum(s_old, TINY))


@triton.jit
def _m4v4_first(grad_p, mv_p, cb, off, mask, s_old, b1, omb1):
    """The new first moment (before re-quantisation), fp32 ``m = cb[code] * s * b1 + g * (1 - b1)``."""
    mv = tl.load(mv_p + off, mask=mask, other=0).to(tl.int32)
    g = tl.load(grad_p + off, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(cb + (mv & 15)) * s_old[:, None]
    return m * b1 + g * omb1, g, mv


@triton.jit
def _m4v4_tile(m, g, mv, param_p, mv_p, v_col_p, v_new_p, cb, R, rows, c, off, mask, s_f, a_new, a_old,
               ints, scal, pidx, PARAM_T: tl.constexpr):
    """Codes, moments and the parameter update of one tile, given its new first moment ``m``
    (fp32), gradient ``g`` (fp32) and old codes ``mv``, and the row's new scale ``s_f``."""
    b2 = tl.load(scal + pidx * N_SCALARS + S_B2)
    omb2 = tl.load(scal + pidx * N_SCALARS + S_OMB2)
    C = tl.load(ints + pidx * N_INTS + I_C)
    row0 = tl.load(ints + pidx * N_INTS + I_ROW0)
    gidx = (row0 + rows)[:, None] * tl.load(ints + pidx * N_INTS + I_ROW_LEN) + c[None, :]
    # second moment: decode against the old factored estimate, EMA, code against the new one
    cmask = c < C
    vhat_new = a_new[:, None] * tl.load(v_new_p + c, mask=cmask, other=0.0)[None, :]
    vhat_old = a_old[:, None] * tl.load(v_col_p + c, mask=cmask, other=0.0)[None, :]
    v = vhat_old * tl.load(R + (mv >> 4))
    v = v * b2 + (g * g) * omb2
    r = tl.div_rn(v, tl.maximum(vhat_new, TINY))
    base_v = tl.load(ints + pidx * N_INTS + I_BASE_V).to(tl.uint32)
    vcode = _encode(r, R, _hash_uniform(gidx, base_v))
    vq = vhat_new * tl.load(R + vcode)
    denom = tl.div_rn(tl.sqrt_rn(vq), tl.load(scal + pidx * N_SCALARS + S_BIAS2)) + tl.load(scal + pidx * N_SCALARS + S_EPS)
    # first moment: code against the row's bf16 max-abs scale
    x = tl.div_rn(m, tl.where(s_f == 0.0, 1.0, s_f)[:, None])
    base_m = tl.load(ints + pidx * N_INTS + I_BASE_M).to(tl.uint32)
    mcode = _encode(x, cb, _hash_uniform(gidx, base_m))
    mq = tl.load(cb + mcode) * s_f[:, None]
    # the update
    p = tl.load(param_p + off, mask=mask, other=0.0).to(tl.float32)
    if tl.load(ints + pidx * N_INTS + I_HAS_WD) != 0:
        p = p * tl.load(scal + pidx * N_SCALARS + S_DECAY)
    upd = tl.div_rn(mq, tl.load(scal + pidx * N_SCALARS + S_BIAS1))
    upd = tl.div_rn(upd, denom)
    neg_lr = tl.load(scal + pidx * N_SCALARS + S_NEG_LR)
    p = tl.fma(upd, neg_lr, p)  # torch's add_(upd, alpha=-lr)
    _store_as(param_p + off, p, mask, PARAM_T)
    tl.store(mv_p + off, (mcode | (vcode << 4)).to(tl.uint8), mask=mask)


@triton.jit
def m4v4_kernel(progs, ptrs, ints, scal, cb, R, BR: tl.constexpr, BC: tl.constexpr, SINGLE: tl.constexpr,
                PARAM_T: tl.constexpr, GRAD_T: tl.constexpr):
    """Phase 2 of an m4v4 step for a table of matrices (rank-local rows, whole rows).
    ptrs = (param, grad, mv_code, m_row_scale, v_row, v_row_new, v_col, v_col_new)."""
    pid = tl.program_id(0)
    pidx = tl.load(progs + 2 * pid)
    r0 = tl.load(progs + 2 * pid + 1)
    param_p = _ptr(ptrs, 0, 8, pidx, PARAM_T)
    grad_p = _ptr(ptrs, 1, 8, pidx, GRAD_T)
    mv_p = _ptr(ptrs, 2, 8, pidx, tl.uint8)
    ms_p = _ptr(ptrs, 3, 8, pidx, tl.bfloat16)
    v_row_p = _ptr(ptrs, 4, 8, pidx, tl.float32)
    v_row_new_p = _ptr(ptrs, 5, 8, pidx, tl.float32)
    v_col_p = _ptr(ptrs, 6, 8, pidx, tl.float32)
    v_new_p = _ptr(ptrs, 7, 8, pidx, tl.float32)
    n_rows = tl.load(ints + pidx * N_INTS + I_ROWS)
    C = tl.load(ints + pidx * N_INTS + I_C)
    b1 = tl.load(scal + pidx * N_SCALARS + S_B1)
    omb1 = tl.load(scal + pidx * N_SCALARS + S_OMB1)
    rows = r0 + tl.arange(0, BR).to(tl.int64)
    rmask = rows < n_rows
    cols = tl.arange(0, BC).to(tl.int64)
    s_old = tl.load(ms_p + rows, mask=rmask, other=0.0).to(tl.float32)
    v_row_new = tl.load(v_row_new_p + rows, mask=rmask, other=0.0)
    a_new = tl.div_rn(v_row_new, tl.load(scal + pidx * N_SCALARS + S_MEAN_NEW))
    a_old = tl.div_rn(tl.load(v_row_p + rows, mask=rmask, other=0.0), tl.load(scal + pidx * N_SCALARS + S_MEAN_OLD))
    if SINGLE:
        off = rows[:, None] * C + cols[None, :]
        mask = rmask[:, None] & (cols < C)[None, :]
        m, g, mv = _m4v4_first(grad_p, mv_p, cb, off, mask, s_old, b1, omb1)
        s_bf = _to_bf16(tl.max(tl.where(mask, tl.abs(m), 0.0), axis=1))
        _m4v4_tile(m, g, mv, param_p, mv_p, v_col_p, v_new_p, cb, R, rows, cols, off, mask, s_bf.to(tl.float32),
                   a_new, a_old, ints, scal, pidx, PARAM_T)
    else:
        s = tl.zeros([BR], dtype=tl.float32)
        for c0 in range(0, C, BC):
            c = c0 + cols
            off = rows[:, None] * C + c[None, :]
            mask = rmask[:, None] & (c < C)[None, :]
            m, _, _ = _m4v4_first(grad_p, mv_p, cb, off, mask, s_old, b1, omb1)
            s = tl.maximum(s, tl.max(tl.where(mask, tl.abs(m), 0.0), axis=1))
        s_bf = _to_bf16(s)
        for c0 in range(0, C, BC):
            c = c0 + cols
            off = rows[:, None] * C + c[None, :]
            mask = rmask[:, None] & (c < C)[None, :]
            m, g, mv = _m4v4_first(grad_p, mv_p, cb, off, mask, s_old, b1, omb1)
            _m4v4_tile(m, g, mv, param_p, mv_p, v_col_p, v_new_p, cb, R, rows, c, off, mask, s_bf.to(tl.float32),
                       a_new, a_old, ints, scal, pidx, PARAM_T)
    tl.store(ms_p + rows, s_bf, mask=rmask)
    tl.store(v_row_p + rows, v_row_new, mask=rmask)


# ----- Gefen m4v4: 1-D and 0-D tensors (AdamW; exp_avg in bf16, stochastically rounded) -----------------------------------
@triton.jit
def adamw_kernel(progs, ptrs, ints, scal, BLOCK: tl.constexpr, PARAM_T: tl.constexpr, GRAD_T: tl.constexpr):
    """ptrs = (param, grad, exp_avg (bf16), exp_avg_sq); ints[I_ROWS] = numel, ints[I_ROW0] = the
    global index of element 0, ints[I_BASE_M] = the first salt's hash base."""
    pid = tl.program_id(0)
    pidx = tl.load(progs + 2 * pid)
    start = tl.load(progs + 2 * pid + 1)
    param_p = _ptr(ptrs, 0, 4, pidx, PARAM_T)
    grad_p = _ptr(ptrs, 1, 4, pidx, GRAD_T)
    m_p = _ptr(ptrs, 2, 4, pidx, tl.bfloat16)
    v_p = _ptr(ptrs, 3, 4, pidx, tl.float32)
    n = tl.load(ints + pidx * N_INTS + I_ROWS)
    off = start + tl.arange(0, BLOCK).to(tl.int64)
    mask = off < n
    g = tl.load(grad_p + off, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(m_p + off, mask=mask, other=0.0).to(tl.float32) * tl.load(scal + pidx * N_SCALARS + S_B1)
    m = m + g * tl.load(scal + pidx * N_SCALARS + S_OMB1)
    v = tl.load(v_p + off, mask=mask, other=0.0) * tl.load(scal + pidx * N_SCALARS + S_B2)
    v = v + (g * g) * tl.load(scal + pidx * N_SCALARS + S_OMB2)
    denom = tl.div_rn(tl.sqrt_rn(v), tl.load(scal + pidx * N_SCALARS + S_BIAS2)) + tl.load(scal + pidx * N_SCALARS + S_EPS)
    p = tl.load(param_p + off, mask=mask, other=0.0).to(tl.float32)
    if tl.load(ints + pidx * N_INTS + I_HAS_WD) != 0:
        p = p * tl.load(scal + pidx * N_SCALARS + S_DECAY)
    upd = tl.div_rn(m, tl.load(scal + pidx * N_SCALARS + S_BIAS1))
    upd = tl.div_rn(upd, denom)
    neg_lr = tl.load(scal + pidx * N_SCALARS + S_NEG_LR)
    p = tl.fma(upd, neg_lr, p)  # torch's add_(upd, alpha=-lr)
    _store_as(param_p + off, p, mask, PARAM_T)
    gidx = tl.load(ints + pidx * N_INTS + I_ROW0) + off
    tl.store(m_p + off, _round_bf16(m, _hash_bits(gidx, tl.load(ints + pidx * N_INTS + I_BASE_M).to(tl.uint32))),
             mask=mask)
    tl.store(v_p + off, v, mask=mask)


# ----- Gefen m4v4 phase 1: row and column sums of g^2 (float64) --------------------------------
@triton.jit
def partials_kernel(progs, ptrs, ints, betas, BR: tl.constexpr, BC: tl.constexpr,
                    GRAD_T: tl.constexpr, M8: tl.constexpr):
    """Phase 1 of either layout, one program per ``BR`` rows: the rows' float64 sums of g^2
    (complete: it owns the rows), the new ``v_row = v_row * b2 + mean(g^2) * (1 - b2)``, and its
    rows' share of every column sum and of the new and old ``v_row`` sums, written to its row of a
    scratch ``[row tiles, C + 2]`` float64 buffer (summed by ``column_sum_kernel``). m4v4's mean
    is the float64 sum / C rounded once; m8's (``functional.second_moment_partials``) is an fp32
    sum divided by C, as torch's ``mean``, and its last slot is 0.
    ptrs = (grad, v_row, v_row_new, scratch); ints[I_ROWS], ints[I_C]; betas = (b2, 1 - b2) fp32."""
    pid = tl.program_id(0)
    pidx = tl.load(progs + 2 * pid)
    r0 = tl.load(progs + 2 * pid + 1)
    grad_p = _ptr(ptrs, 0, 4, pidx, GRAD_T)
    v_row_p = _ptr(ptrs, 1, 4, pidx, tl.float32)
    v_new_p = _ptr(ptrs, 2, 4, pidx, tl.float32)
    scratch = _ptr(ptrs, 3, 4, pidx, tl.float64)
    n_rows = tl.load(ints + pidx * N_INTS + I_ROWS)
    C = tl.load(ints + pidx * N_INTS + I_C)
    out = scratch + (r0 // BR) * (C + 2)
    rows = r0 + tl.arange(0, BR).to(tl.int64)
    rmask = rows < n_rows
    cols = tl.arange(0, BC).to(tl.int64)
    row_sum = tl.zeros([BR], dtype=tl.float64)
    for c0 in range(0, C, BC):
        c = c0 + cols
        mask = rmask[:, None] & (c < C)[None, :]
        g = tl.load(grad_p + rows[:, None] * C + c[None, :], mask=mask, other=0.0).to(tl.float32)
        sq = (g * g).to(tl.float64)
        row_sum += tl.sum(sq, axis=1)
        tl.store(out + c, tl.sum(sq, axis=0), mask=c < C)
    v_old = tl.load(v_row_p + rows, mask=rmask, other=0.0)
    if M8:
        mean = tl.div_rn(row_sum.to(tl.float32), C.to(tl.float32))
    else:
        mean = (row_sum / tl.maximum(C, 1).to(tl.float64)).to(tl.float32)
    v_new = v_old * tl.load(betas + 2 * pidx) + mean * tl.load(betas + 2 * pidx + 1)
    tl.store(v_new_p + rows, v_new, mask=rmask)
    tl.store(out + C, tl.sum(tl.where(rmask, v_new, 0.0).to(tl.float64), axis=0))
    if M8:
        tl.store(out + C + 1, 0.0)
    else:
        tl.store(out + C + 1, tl.sum(tl.where(rmask, v_old, 0.0).to(tl.float64), axis=0))


@triton.jit
def column_sum_kernel(progs, ptrs, ints, BC: tl.constexpr, BR: tl.constexpr):
    """``partials[c] = sum over row tiles of scratch[t, c]`` (float64, tiles in order).
    ptrs = (scratch, partials); programs = (parameter, first column)."""
    pid = tl.program_id(0)
    pidx = tl.load(progs + 2 * pid)
    c0 = tl.load(progs + 2 * pid + 1)
    scratch = _ptr(ptrs, 0, 2, pidx, tl.float64)
    parts = _ptr(ptrs, 1, 2, pidx, tl.float64)
    n_rows = tl.load(ints + pidx * N_INTS + I_ROWS)
    width = tl.load(ints + pidx * N_INTS + I_C) + 2
    c = c0 + tl.arange(0, BC).to(tl.int64)
    cmask = c < width
    acc = tl.zeros([BC], dtype=tl.float64)
    for t in range(0, tl.cdiv(n_rows, BR)):
        acc += tl.load(scratch + t * width + c, mask=cmask, other=0.0)
    tl.store(parts + c, acc, mask=cmask)


# ----- Gefen m8 (contract version "1"): 8-bit first-moment codes, block or factored second moment
# scalar table columns (fp32, one row per parameter): lerp weight 1 - b1, b2, 1 - b2, 1 - b1^t,
# sqrt(1 - b2^t), eps, -lr, 1 - lr * wd, the factored row mean (written by m8_prologue_kernel)
M_W, M_B2, M_OMB2, M_BIAS1, M_BIAS2, M_EPS, M_NEG_LR, M_DECAY, M_ROW_MEAN = map(tl.constexpr, range(9))
M_NSCAL = tl.constexpr(9)
# int table columns (int64): blocks, block length P, blocks per row, row length C, weight decay flag,
# global rows (the divisor of the factored column and row sums)
J_NB, J_P, J_BPR, J_C, J_HAS_WD, J_GROWS = map(tl.constexpr, range(6))
M_NINTS = tl.constexpr(6)


@triton.jit
def m8_prologue_kernel(progs, ptrs, ints, scal, BC: tl.constexpr):
    """Factored matrices before the step: ``v_col = v_col * b2 + fp32(col_sum / rows) * (1 - b2)``
    in place (torch's ``mul_`` then ``add_(alpha=)``: one FMA) and, by the program of column 0, the
    row mean ``max(fp32(S / rows), TINY)`` into the scalar table.
    ptrs = (v_col, partials[f64: col sums..., S]); programs = (parameter, first column)."""
    pid = tl.program_id(0)
    pidx = tl.load(progs + 2 * pid)
    c0 = tl.load(progs + 2 * pid + 1)
    v_col = _ptr(ptrs, 0, 2, pidx, tl.float32)
    parts = _ptr(ptrs, 1, 2, pidx, tl.float64)
    C = tl.load(ints + pidx * M_NINTS + J_C)
    grows = tl.load(ints + pidx * M_NINTS + J_GROWS).to(tl.float64)
    b2 = tl.load(scal + pidx * M_NSCAL + M_B2)
    omb2 = tl.load(scal + pidx * M_NSCAL + M_OMB2)
    c = c0 + tl.arange(0, BC).to(tl.int64)
    mask = c < C
    col_mean = (tl.load(parts + c, mask=mask, other=0.0) / grows).to(tl.float32)
    tl.store(v_col + c, tl.fma(col_mean, omb2, tl.load(v_col + c, mask=mask, other=0.0) * b2), mask=mask)
    if c0 == 0:
        row_mean = (tl.load(parts + C) / grows).to(tl.float32)
        tl.store(scal + pidx * M_NSCAL + M_ROW_MEAN, tl.maximum(row_mean, TINY, propagate_nan=tl.PropagateNan.ALL))


@triton.jit
def _m8_apply(m, s, den, param_p, codes_p, off, mask, sb, has_wd, cb, thr, K, LOG2K: tl.constexpr,
              PARAM_T: tl.constexpr):
    """Re-quantise a tile's new first moment ``m`` (block max-abs ``s``), store its codes and apply
    ``p = p * (1 - lr wd) - lr * (cb[code] * s / (1 - b1^t)) / den`` (torch's op order)."""
    code, mq = _requantise(m, s, cb, thr, K, LOG2K)
    tl.store(codes_p + off, code.to(tl.uint8), mask=mask)
    p = tl.load(param_p + off, mask=mask, other=0.0).to(tl.float32)
    if has_wd:
        p = p * tl.load(sb + M_DECAY)
    upd = tl.div_rn(tl.div_rn(mq, tl.load(sb + M_BIAS1)), den)
    p = tl.fma(upd, tl.load(sb + M_NEG_LR), p)  # torch's add_(upd, alpha=-lr)
    _store_as(param_p + off, p, mask, PARAM_T)


@triton.jit
def _m8_factored_den(v_p, v_col_p, blocks, c, bmask, mask, bpr, P, sb):
    """``sqrt(v_row[i] * v_col[j] / row_mean) / sqrt(1 - b2^t) + eps`` per element of the tile."""
    v_row = tl.load(v_p + blocks // bpr, mask=bmask, other=0.0)
    j = (blocks % bpr)[:, None] * P + c[None, :]
    v_col = tl.load(v_col_p + j, mask=mask, other=0.0)
    den = tl.div_rn(v_row[:, None] * v_col, tl.load(sb + M_ROW_MEAN))
    return tl.div_rn(tl.sqrt_rn(den), tl.load(sb + M_BIAS2)) + tl.load(sb + M_EPS)


@triton.jit
def _m8_block_den(sq_sum, v_p, blocks, bmask, P, sb):
    """The block path's new ``v = v * b2 + mean(g^2) * (1 - b2)`` (stored; the mean an fp32 sum
    divided by P, as torch's ``mean``) and its ``sqrt(v) / sqrt(1 - b2^t) + eps`` per block."""
    mean = tl.div_rn(sq_sum.to(tl.float32), P.to(tl.float32))
    v = tl.fma(mean, tl.load(sb + M_OMB2), tl.load(v_p + blocks, mask=bmask, other=0.0) * tl.load(sb + M_B2))
    tl.store(v_p + blocks, v, mask=bmask)
    return (tl.div_rn(tl.sqrt_rn(v), tl.load(sb + M_BIAS2)) + tl.load(sb + M_EPS))[:, None]


@triton.jit
def m8_kernel(progs, ptrs, ints, scal, cb, thr, K, LOG2K: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
              SINGLE: tl.constexpr, FACTORED: tl.constexpr, PARAM_T: tl.constexpr, GRAD_T: tl.constexpr):
    """Phase 2 of an m8 step (``functional.gefen_update_``) for a table of parameters viewed as
    ``[blocks, P]``, ``BR`` blocks per program: second moment and denominators, the compressed first
    moment (as ``momentum_kernel``) and the parameter update, every state byte read and written once
    (two passes over a block longer than ``BC``: its max-abs comes first).
    ptrs = (param, grad, m_code, m_scale, v (block path) or the new v_row (factored), v_col (factored:
    already updated by ``m8_prologue_kernel``))."""
    pid = tl.program_id(0)
    pidx = tl.load(progs + 2 * pid)
    b0 = tl.load(progs + 2 * pid + 1)
    param_p = _ptr(ptrs, 0, 6, pidx, PARAM_T)
    grad_p = _ptr(ptrs, 1, 6, pidx, GRAD_T)
    codes_p = _ptr(ptrs, 2, 6, pidx, tl.uint8)
    scales_p = _ptr(ptrs, 3, 6, pidx, tl.float32)
    v_p = _ptr(ptrs, 4, 6, pidx, tl.float32)
    v_col_p = _ptr(ptrs, 5, 6, pidx, tl.float32)
    ib = ints + pidx * M_NINTS
    sb = scal + pidx * M_NSCAL
    nb = tl.load(ib + J_NB)
    P = tl.load(ib + J_P)
    bpr = tl.load(ib + J_BPR)
    has_wd = tl.load(ib + J_HAS_WD) != 0
    w = tl.load(sb + M_W)
    small = w < 0.5
    blocks = b0 + tl.arange(0, BR).to(tl.int64)
    bmask = blocks < nb
    cols = tl.arange(0, BC).to(tl.int64)
    scale = tl.load(scales_p + blocks, mask=bmask, other=0.0)
    if SINGLE:
        off = blocks[:, None] * P + cols[None, :]
        mask = bmask[:, None] & (cols < P)[None, :]
        m, g = _momentum_and_grad(grad_p, codes_p, cb, off, mask, scale, w, small)
        s = tl.max(tl.where(mask, tl.abs(m), 0.0), axis=1)
        if FACTORED:
            den = _m8_factored_den(v_p, v_col_p, blocks, cols, bmask, mask, bpr, P, sb)
        else:
            den = _m8_block_den(tl.sum((g * g).to(tl.float64), axis=1), v_p, blocks, bmask, P, sb)
        _m8_apply(m, s, den, param_p, codes_p, off, mask, sb, has_wd, cb, thr, K, LOG2K, PARAM_T)
    else:
        s = tl.zeros([BR], dtype=tl.float32)
        sq_sum = tl.zeros([BR], dtype=tl.float64)
        for c0 in range(0, P, BC):
            c = c0 + cols
            off = blocks[:, None] * P + c[None, :]
            mask = bmask[:, None] & (c < P)[None, :]
            m, g = _momentum_and_grad(grad_p, codes_p, cb, off, mask, scale, w, small)
            s = tl.maximum(s, tl.max(tl.where(mask, tl.abs(m), 0.0), axis=1))
            if not FACTORED:
                sq_sum += tl.sum((g * g).to(tl.float64), axis=1)
        if not FACTORED:
            block_den = _m8_block_den(sq_sum, v_p, blocks, bmask, P, sb)
        for c0 in range(0, P, BC):
            c = c0 + cols
            off = blocks[:, None] * P + c[None, :]
            mask = bmask[:, None] & (c < P)[None, :]
            m = _momentum_tile(grad_p, codes_p, cb, off, mask, scale, w, small)
            if FACTORED:
                den = _m8_factored_den(v_p, v_col_p, blocks, c, bmask, mask, bpr, P, sb)
            else:
                den = block_den
            _m8_apply(m, s, den, param_p, codes_p, off, mask, sb, has_wd, cb, thr, K, LOG2K, PARAM_T)
    tl.store(scales_p + blocks, s, mask=bmask)
