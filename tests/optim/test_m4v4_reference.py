"""The m4v4 torch reference (gefen/stochastic.py, gefen/functional.py) against the arithmetic
written out independently in numpy float32 (one IEEE op per line, as docs/format.md states it),
plus the properties the layout relies on: unbiased rounding, layout-independent noise."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gefen.codebook import solve_codebook
from gefen.functional import (
    Hyper,
    adamw_update_,
    init_m4v4_state,
    inverse_step_bound,
    m4v4_partials,
    m4v4_update_,
)
from gefen.stochastic import (
    GUARD,
    LOG_RANGE,
    element_index,
    encode,
    encode_v,
    hash_bits,
    hash_uniform,
    ratio_table,
    round_bf16,
    salts,
    standin_codebook,
    v_grid,
)

F32 = np.float32
TINY = np.finfo(np.float32).tiny


# ----- an independent numpy model of the spec ------------------------------------------------
def np_hash(gidx: np.ndarray, t: int, salt: int) -> np.ndarray:
    m = 0xFFFFFFFF
    x = (gidx.astype(object) * 0x9E3779B1 + t * 0x85EBCA77 + salt * 0xC2B2AE3D) % 2**32
    x = np.array([int(v) for v in x.ravel()], dtype=np.uint64).reshape(gidx.shape)
    x = ((x ^ (x >> np.uint64(16))) * np.uint64(0x7FEB352D)) & np.uint64(m)
    x = ((x ^ (x >> np.uint64(15))) * np.uint64(0x846CA68B)) & np.uint64(m)
    x = x ^ (x >> np.uint64(16))
    return (x >> np.uint64(8)).astype(F32) * F32(2.0**-24)


def np_encode(x: np.ndarray, table: np.ndarray, u: np.ndarray) -> np.ndarray:
    hi = np.clip(np.searchsorted(table, x, side="left"), 1, 15)
    lo = hi - 1
    p = np.clip((x - table[lo]) / np.maximum(table[hi] - table[lo], F32(1e-12)), F32(0), F32(1))
    return np.where(u < p, hi, lo)


def np_curvatures(vcb: np.ndarray, power: float = 1.0 / 3.0) -> np.ndarray:
    """K[k] = clip(4 (f - 1/2), -1, 1), f = ((1 + rho) / 2)^a - 1) / (rho^a - 1), rho = R[k+1] / R[k],
    in float64, rounded once to fp32; K[15] = 0."""
    logs = vcb.astype(np.float64) * 8
    rho = np.exp(np.maximum(np.diff(logs), 0.0))
    wide = rho > 1.0 + 1e-9
    safe = np.where(wide, rho, 2.0)
    frac = np.where(wide, (((1.0 + safe) / 2.0) ** power - 1.0) / (safe**power - 1.0), 0.5)
    return np.append(np.clip(4.0 * (frac - 0.5), -1.0, 1.0), 0.0).astype(F32)


def np_encode_v(x: np.ndarray, table: np.ndarray, kappa: np.ndarray, u: np.ndarray) -> np.ndarray:
    hi = np.clip(np.searchsorted(table, x, side="left"), 1, 15)
    lo = hi - 1
    p = np.clip((x - table[lo]) / np.maximum(table[hi] - table[lo], F32(1e-12)), F32(0), F32(1))
    p = p + kappa[lo] * (p * (F32(1) - p))
    return np.where(u < p, hi, lo)


def np_step(param, grad, st, cb, vcb, lr, b1, b2, eps, wd, pidx, seed):
    """One m4v4 step of a whole (unsharded) matrix; returns new (param, mv_code, scale_bf16_as_f32, v_row, v_col)."""
    R = np.exp(vcb.astype(np.float64) * 8).astype(F32)
    rows, C = grad.shape
    t = st["step"] + 1
    g = grad.astype(F32)
    sq = g * g
    row_sum = sq.astype(np.float64).sum(1)
    v_row_new = st["v_row"] * F32(b2) + (row_sum / C).astype(F32) * F32(1 - b2)
    col_sum = sq.astype(np.float64).sum(0)
    S_new, S_old = v_row_new.astype(np.float64).sum(), st["v_row"].astype(np.float64).sum()
    v_col_new = st["v_col"] * F32(b2) + (col_sum / rows).astype(F32) * F32(1 - b2)
    mean_new = max(F32(S_new / rows), TINY)
    mean_old = max(F32(S_old / rows), TINY)
    vhat_new = (v_row_new / mean_new)[:, None] * v_col_new[None, :]
    vhat_old = (st["v_row"] / mean_old)[:, None] * st["v_col"][None, :]
    gidx = np.arange(rows * C, dtype=np.int64).reshape(rows, C)
    salt_m = (2 * pidx + 7919 * seed) % 2**32
    v = vhat_old * R[st["mv_code"] >> 4]
    v = v * F32(b2) + sq * F32(1 - b2)
    r = v / np.maximum(vhat_new, TINY)
    vcode = np_encode_v(r, R, np_curvatures(vcb), np_hash(gidx, t, salt_m + 1))
    vq = vhat_new * R[vcode]
    # torch's CPU square root (MKL's, not always correctly rounded: the spec says "torch's sqrt")
    root = torch.from_numpy(vq).sqrt().numpy() / F32(math.sqrt(1 - b2**t))
    m = cb[st["mv_code"] & 15] * st["scale"][:, None]
    m = m * F32(b1) + g * F32(1 - b1)
    s = np.abs(m).max(1)
    s_f = torch.from_numpy(s).to(torch.bfloat16).float().numpy()  # bf16 round-to-nearest-even
    x = m / np.where(s_f == 0, F32(1), s_f)[:, None]
    mcode = np_encode(x, cb, np_hash(gidx, t, salt_m))
    p = param * F32(1 - lr * wd)
    upd = m / F32(1 - b1**t)  # the fp32 first moment, not its code
    # the bounded denominator: never below |m_hat| / step_bound (fp32 of its inverse, as torch rounds a scalar)
    upd = upd / (np.maximum(root, np.abs(upd) * F32(inverse_step_bound(t, b1, b2))) + F32(eps))
    # param + (-lr) * upd with one rounding (torch's add_(alpha=) and the C kernel use a fused
    # multiply-add there): the product of two fp32 is exact in float64
    p = (p.astype(np.float64) + upd.astype(np.float64) * np.float64(F32(-lr))).astype(F32)
    return p, (mcode | (vcode << 4)).astype(np.uint8), s_f, v_row_new, v_col_new


# ----- the pure helpers ----------------------------------------------------------------------
def test_hash_matches_the_spec_formula_including_wraparound():
    gidx = np.array([[0, 1, 2, 2**31 - 1], [2**32 + 5, 3 * 2**40 + 7, 12345678901, 2**62 + 3]], dtype=np.int64)
    for t, salt in ((1, 0), (7, 1), (123456, 2**32 - 1)):
        want = np_hash(gidx, t, salt)
        got = hash_uniform(torch.from_numpy(gidx), t, salt).numpy()
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, want)
    u = hash_uniform(torch.arange(100_000), 3, 11)
    assert 0 <= float(u.min()) and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.01  # roughly uniform
    assert salts(3, 2) == (6 + 7919 * 2, 7 + 7919 * 2)
    assert salts(0, 2**31)[0] == (7919 * 2**31) % 2**32


def test_element_index_is_the_global_flat_index_on_any_row_or_column_split():
    whole = element_index(6, 10, row0=0, row_len=10)
    assert torch.equal(whole.reshape(-1), torch.arange(60))
    assert torch.equal(element_index(2, 10, row0=3, row_len=10), whole[3:5])
    assert torch.equal(element_index(2, 4, row0=3, row_len=10, col0=5), whole[3:5, 5:9])


def test_encode_end_points_ties_and_out_of_range():
    table = standin_codebook()
    u = torch.full((5,), 0.999)
    x = torch.tensor([-1.0, float(table[5]), 1.0, -3.0, 7.0])
    assert encode(x, table, u).tolist() == [0, 5, 15, 0, 15]
    assert encode(x, table, torch.zeros(5)).tolist() == [0, 5, 15, 0, 15]
    # a repeated entry (a DP codebook can pad with +1): exact hits take the first equal entry
    dup = torch.tensor([-1.0] + [0.0] * 14 + [1.0])
    assert encode(torch.tensor([0.0, 0.5, 0.5]), dup, torch.tensor([0.5, 0.25, 0.5])).tolist() == [1, 15, 14]
    assert GUARD == float(np.float32(1e-12))


def test_encode_is_unbiased():
    table = torch.sort(torch.rand(16, generator=torch.Generator().manual_seed(0)) * 2 - 1).values
    table[0], table[-1] = -1.0, 1.0
    x = torch.tensor([-0.93, -0.2, 0.0, 0.37, 0.999])
    n = 200_000
    u = hash_uniform(torch.arange(n * 5).view(n, 5), 1, 0)
    decoded = table[encode(x.expand(n, 5), table, u)]
    assert torch.allclose(decoded.mean(0), x, atol=3e-3)


def test_ratio_table_is_exp_8c_then_the_curvatures_rounded_once_from_float64():
    vcb = solve_codebook(torch.randint(0, 50, (256,), generator=torch.Generator().manual_seed(1)), 16)
    want = np.exp(vcb.numpy().astype(np.float64) * 8).astype(np.float32)
    np.testing.assert_array_equal(ratio_table(vcb).numpy(), np.concatenate([want, np_curvatures(vcb.numpy())]))
    np.testing.assert_array_equal(ratio_table(v_grid()).numpy()[16:], np_curvatures(v_grid().numpy()))


def test_v_grid_is_the_documented_sinh_grid_with_bounded_gaps():
    grid = v_grid().double() * LOG_RANGE  # nats
    t = np.linspace(-1, 1, 16)
    np.testing.assert_allclose(grid.numpy(), 8 * np.sinh(3.35 * t) / np.sinh(3.35), rtol=1e-6)
    gaps = grid.diff()
    assert grid[0] == -8 and grid[-1] == 8 and (gaps > 0).all()
    assert gaps.min() > 0.25 and gaps[6:9].max() < 0.3  # 0.25 nats apart at the centre
    assert gaps.max() < 2.9  # the widest gap: a step at most exp(2.9 / 2) = 4.2x the code above's


@pytest.mark.parametrize("power", [1.0, 1.0 / 3.0])
def test_encode_v_is_unbiased_in_v_to_the_power(power, monkeypatch):
    """The bent interpolation leaves ``E[R[code] ** a] = x ** a`` inside every interval (to the
    quadratic's accuracy: < 2% of the interval up to 1.9 nats wide), where plain rounding (a = 1) is unbiased in v."""
    monkeypatch.setattr("gefen.stochastic.V_POWER", power)
    table = ratio_table(v_grid())
    R = table[:16].double()
    lo = torch.arange(3, 13)
    frac = torch.tensor([0.1, 0.3, 0.5, 0.7, 0.9], dtype=torch.float64)
    x = (R[lo, None] * (1 - frac) + R[lo + 1, None] * frac).float()  # [10 intervals, 5 points]
    n = 100_000
    u = hash_uniform(torch.arange(n * x.numel()).view(n, *x.shape), 3, 1)
    got = (R.take(encode_v(x.expand(n, *x.shape), table, u)) ** power).mean(0)
    want = x.double() ** power
    span = R[lo + 1, None] ** power - R[lo, None] ** power
    assert ((got - want).abs() / span).max() < 0.02
    if power != 1.0:  # and biased in v, upwards (Jensen), as it must be
        assert ((R.take(encode_v(x.expand(n, *x.shape), table, u))).mean(0) > x.double()).all()


# ----- one step against the numpy model ------------------------------------------------------
def _problem(seed: int, rows: int = 6, cols: int = 40):
    gen = torch.Generator().manual_seed(seed)
    param = torch.randn(rows, cols, generator=gen)
    grads = [torch.randn(rows, cols, generator=gen) * (0.1 + i) for i in range(4)]
    cb = solve_codebook(torch.randint(0, 30, (256,), generator=gen), 16)
    vcb = solve_codebook(torch.randint(0, 30, (256,), generator=gen), 16)
    return param, grads, cb, vcb


def _torch_step(param, grad, state, cb, vcb, h, pidx, seed):
    v_row, partials = m4v4_partials(grad, state, h.beta2)
    m4v4_update_(param, grad, state, cb, ratio_table(vcb), h, global_rows=param.shape[0], v_row=v_row,
                 partials=partials, pidx=pidx, seed=seed)


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_m4v4_step_matches_the_numpy_model_bit_for_bit(wd):
    param, grads, cb, vcb = _problem(0)
    h = Hyper(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=wd)
    state = init_m4v4_state(param, tuple(param.shape))
    np_p = param.numpy().copy()
    np_st = {"step": 0, "mv_code": np.zeros(param.shape, np.uint8), "scale": np.zeros(6, np.float32),
             "v_row": np.zeros(6, np.float32), "v_col": np.zeros(40, np.float32)}
    for grad in grads:
        _torch_step(param, grad, state, cb, vcb, h, pidx=3, seed=1)
        np_p, code, scale, v_row, v_col = np_step(np_p, grad.numpy(), np_st, cb.numpy(), vcb.numpy(), h.lr,
                                                   h.beta1, h.beta2, h.eps, wd, 3, 1)
        np_st = {"step": np_st["step"] + 1, "mv_code": code, "scale": scale, "v_row": v_row, "v_col": v_col}
        np.testing.assert_array_equal(state["mv_code"].numpy(), code)
        np.testing.assert_array_equal(state["m_row_scale"].float().numpy(), scale)
        np.testing.assert_array_equal(state["v_row"].numpy(), v_row)
        np.testing.assert_array_equal(state["v_col"].numpy(), v_col)
        np.testing.assert_array_equal(param.numpy(), np_p)
    assert int(state["step"]) == 4
    assert state["m_row_scale"].dtype == torch.bfloat16
    assert len(set((state["mv_code"] >> 4).reshape(-1).tolist())) > 3  # the v codes move


def test_m4v4_step_is_independent_of_the_row_split():
    """Two row shards (partials summed as the all-reduce would) reproduce the whole tensor's step."""
    param, grads, cb, vcb = _problem(1, rows=7, cols=12)
    h = Hyper(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1)
    ratio = ratio_table(vcb)
    whole, st = param.clone(), init_m4v4_state(param, (7, 12))
    parts = [param[:4].clone(), param[4:].clone()]
    sts = [init_m4v4_state(parts[0], (7, 12)), init_m4v4_state(parts[1], (7, 12))]
    for grad in grads:
        _torch_step(whole, grad, st, cb, vcb, h, pidx=5, seed=0)
        halves = [grad[:4], grad[4:]]
        results = [m4v4_partials(g, s, h.beta2) for g, s in zip(halves, sts)]
        total = results[0][1] + results[1][1]
        for i, (p, g, s, (v_row, _)) in enumerate(zip(parts, halves, sts, results)):
            m4v4_update_(p, g, s, cb, ratio, h, global_rows=7, v_row=v_row, partials=total.clone(), pidx=5,
                         seed=0, row0=4 * i)
    assert torch.equal(torch.cat(parts), whole)
    assert torch.equal(torch.cat([s["mv_code"] for s in sts]), st["mv_code"])
    assert torch.equal(torch.cat([s["m_row_scale"] for s in sts]), st["m_row_scale"])


def test_m4v4_step_seeds_and_positions_change_the_noise_only():
    param, grads, cb, vcb = _problem(2)
    h = Hyper(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    out, stats = [], []
    for pidx, seed in ((0, 0), (0, 1), (1, 0), (0, 0)):
        p, st = param.clone(), init_m4v4_state(param, tuple(param.shape))
        for grad in grads:
            _torch_step(p, grad, st, cb, vcb, h, pidx, seed)
        out.append(p)
        stats.append((st["v_row"], st["v_col"]))
    assert not torch.equal(out[0], out[1]) and not torch.equal(out[0], out[2])
    assert torch.equal(out[0], out[3])  # deterministic
    for v_row, v_col in stats[1:]:  # the factored statistics do not depend on the noise
        assert torch.equal(v_row, stats[0][0]) and torch.equal(v_col, stats[0][1])


def test_first_step_ignores_whatever_the_codes_hold():
    """At step 1 v_row_old = 0, so the old moments decode to exactly 0 whatever the codes say."""
    param, grads, cb, vcb = _problem(3)
    h = Hyper(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    a, b = param.clone(), param.clone()
    sa, sb = init_m4v4_state(a, tuple(a.shape)), init_m4v4_state(b, tuple(b.shape))
    sb["mv_code"].fill_(0xF7)
    _torch_step(a, grads[0], sa, cb, vcb, h, 0, 0)
    _torch_step(b, grads[0], sb, cb, vcb, h, 0, 0)
    assert torch.equal(a, b) and torch.equal(sa["mv_code"], sb["mv_code"])


def test_bf16_parameter_step_runs_in_fp32_and_rounds_once():
    param, grads, cb, vcb = _problem(4)
    h = Hyper(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
    p32, pbf = param.bfloat16().float(), param.bfloat16()
    s32, sbf = init_m4v4_state(p32, tuple(p32.shape)), init_m4v4_state(pbf, tuple(pbf.shape))
    grad = grads[0].bfloat16()
    _torch_step(p32, grad.float(), s32, cb, vcb, h, 0, 0)
    _torch_step(pbf, grad, sbf, cb, vcb, h, 0, 0)
    assert pbf.dtype == torch.bfloat16 and torch.equal(pbf, p32.bfloat16())


def np_round_bf16(x: np.ndarray, bits: np.ndarray) -> np.ndarray:
    """The spec's bf16 stochastic rounding on uint32 bit patterns, as float32 values."""
    b = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return (((b + (bits.astype(np.uint64) >> 16)) >> 16) << 16).astype(np.uint32).view(np.float32)


def test_round_bf16_matches_the_formula_keeps_bf16_values_and_is_unbiased():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2000, generator=gen) * torch.logspace(-30, 30, 2000)
    bits = hash_bits(torch.arange(2000), 4, 9)
    got = round_bf16(x, bits)
    assert got.dtype == torch.bfloat16
    np.testing.assert_array_equal(got.float().numpy(), np_round_bf16(x.numpy(), bits.numpy()))
    # a value bf16 holds is kept; anything else goes to one of its two bf16 neighbours
    exact = x.bfloat16()
    assert torch.equal(round_bf16(exact.float(), bits), exact)
    lo_bits = x.view(torch.int32) & -(1 << 16)  # the bf16 neighbour toward zero, then the one away
    lo, hi = lo_bits.view(torch.float32), (lo_bits + (1 << 16)).view(torch.float32)
    assert bool(((got.float() == lo) | (got.float() == hi)).all())
    # E[round(x)] = x: 1/3 of the way from 1 to the next bf16 value, over 200k hash draws
    third = torch.full((200_000,), 1.0 + 2.0**-7 / 3)
    mean = round_bf16(third, hash_bits(torch.arange(200_000), 1, 0)).double().mean()
    assert abs(float(mean) - (1.0 + 2.0**-7 / 3)) < 2.0**-7 * 0.01
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0])
    out = round_bf16(special, hash_bits(torch.arange(5), 1, 0)).float()
    assert out[0].isnan() and out[1] == float("inf") and out[2] == -float("inf") and not out[3:].any()


def test_vector_path_is_adamw_with_a_stochastically_rounded_first_moment():
    """With torch AdamW's exp_avg set to the stored bf16 one after every step, the parameters
    agree to fp32 rounding; the stored moment is always a bf16 neighbour of AdamW's fp32 one."""
    gen = torch.Generator().manual_seed(5)
    p = torch.randn(33, generator=gen)
    ref = p.clone().requires_grad_()
    opt = torch.optim.AdamW([ref], lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    h = Hyper(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1)
    st = init_m4v4_state(p, (33,))
    assert set(st) == {"step", "exp_avg", "exp_avg_sq"} and st["exp_avg"].dtype == torch.bfloat16
    rounded_up = 0
    for step in range(1, 21):
        g = torch.randn(33, generator=gen)
        ref.grad = g.clone()
        opt.step()
        adamw_update_(p, g, st, h, pidx=2, seed=7, row0=100)
        torch.testing.assert_close(p, ref.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(st["exp_avg_sq"], opt.state[ref]["exp_avg_sq"], rtol=1e-5, atol=0)
        m = opt.state[ref]["exp_avg"]
        want = round_bf16(m, hash_bits(torch.arange(100, 133), step, salts(2, 7)[0]))
        assert torch.equal(st["exp_avg"], want), f"step {step}"
        rounded_up += int((want.float().abs() > m.abs()).sum())
        m.copy_(st["exp_avg"].float())
    assert 100 < rounded_up < 560  # both directions occur (660 roundings in all)


def test_empty_rows_keep_zero_statistics():
    for shape in ((0, 5), (4, 0)):
        p = torch.zeros(shape)
        st = init_m4v4_state(p, shape)
        h = Hyper(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
        _torch_step(p, torch.zeros(shape), st, standin_codebook(), standin_codebook(), h, 0, 0)
        assert int(st["step"]) == 1
        assert not st["v_col"].isnan().any() and not st["v_row"].isnan().any()
