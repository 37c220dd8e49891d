"""The C kernels on shards whose columns tensor parallelism splits (``Shard(1)``), against the torch
reference given the same row statistics.

A column split's step has three phases: this shard's per-row statistics (``m4v4_row_stats``:
float64 sums of g^2 and max |m|; GefenMuon: the momentum's block scales), their reduction over
the tensor-parallel ranks (here: a stand-in, the local statistics scaled up as the other columns'
ranks would raise them), then phases 1 and 2 given the reduced statistics, the shard's first row
and column and the global row length. Every kernel must apply (no fallback). m4v4: the float64
row statistics agree within 1e-12 relative (the kernels' fixed summation order), the state and
the parameter within the kernels' stated bound (``parity.m4v4_disagreement``), the row max bit
for bit; GefenMuon's momentum (the m8 kernel): every state tensor bit for bit (compared as integers).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import gefen.c_kernels as c_kernels
from gefen import functional as F
from gefen import parity
from gefen.codebook import histogram_normalised_blocks
from gefen.quant import block_scales
from gefen.stochastic import ratio_table

HYPER = F.Hyper(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1)
_INTS = {torch.float32: torch.int32, torch.bfloat16: torch.int16}


@pytest.fixture(autouse=True)
def _restore():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def assert_identical(a: torch.Tensor, b: torch.Tensor, what: str):
    assert a.dtype == b.dtype and a.shape == b.shape, what
    if a.dtype in _INTS:
        a, b = a.view(_INTS[a.dtype]), b.view(_INTS[b.dtype])
    assert torch.equal(a, b), f"{what}: {(a != b).sum().item()} of {a.numel()} elements differ"


def assert_close_f64(a: torch.Tensor, b: torch.Tensor, what: str):
    assert a.dtype == b.dtype and a.shape == b.shape, what
    torch.testing.assert_close(a, b, rtol=parity.M4V4_F64_RTOL, atol=0.0, msg=what)


def _book(gen: torch.Generator, k: int) -> torch.Tensor:
    book = torch.sort(torch.rand(k, generator=gen) * 2 - 1).values
    book[0], book[-1] = -1.0, 1.0
    return book


def _grad(gen, shape, dtype, zero_row: bool) -> torch.Tensor:
    g = torch.randn(shape, generator=gen) * (torch.rand(shape[0], 1, generator=gen) + 0.1)
    if zero_row and shape[0] > 2:
        g[2] = 0
    return g.to(dtype)


#: (local rows, local columns, global row length, first column, threads): one tile and the
#: threaded path (>= 32768 elements), one row (torch's two-pass row sum), a shard at column 0
SHARDS = [(37, 33, 80, 20, 1), (70, 600, 1500, 700, 2), (1, 3000, 6000, 3000, 2), (9, 16, 48, 0, 1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows,cols,row_len,col0,threads", SHARDS, ids=str)
def test_m4v4_column_shard_matches_the_reference(rows, cols, row_len, col0, threads, dtype):
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(rows + cols)
    cb, ratio = _book(gen, 16), ratio_table(_book(gen, 16))
    p_ref = (torch.randn(rows, cols, generator=gen) * 0.1).to(dtype)
    s_ref = F.init_m4v4_state(p_ref, (rows + 11, row_len))
    p, s = p_ref.clone(), copy.deepcopy(s_ref)
    before = p_ref.clone()
    row0 = 5  # a row shard too: the hash uses the global index (row0 + r) * row_len + col0 + c
    for step in range(3):
        g = _grad(gen, (rows, cols), dtype, zero_row=step == 1)
        stats = c_kernels.m4v4_row_stats(g, s, cb, HYPER.beta1)
        assert stats is not None, "the row statistics kernel did not apply"
        assert_close_f64(stats[0], F.row_square_sums(g), f"step {step}: row sums of g^2")
        assert_identical(stats[1], F.row_abs_max(F.m4v4_momentum(g, s_ref, cb, HYPER.beta1)), f"step {step}: row max")
        # the whole rows' statistics, as the reduction over tp gives them (other columns add to them)
        row_sum = stats[0] * 1.75 + 0.5
        row_max = torch.maximum(stats[1] * 1.5, torch.full_like(stats[1], 0.25 * step))
        phase1 = c_kernels.m4v4_partials(g, s, HYPER.beta2, row_sum=row_sum, row_len=row_len)
        assert phase1 is not None, "phase 1 did not apply"
        v_row, parts = F.m4v4_partials(g, s_ref, HYPER.beta2, row_sum=row_sum, row_len=row_len)
        torch.testing.assert_close(phase1[0], v_row, rtol=parity.M4V4_STAT_RTOL, atol=0.0)
        assert_close_f64(phase1[1], parts, f"step {step}: partials")
        kw = dict(global_rows=rows + 11, v_row=v_row, partials=parts * 1.5, pidx=4, seed=2, row0=row0, col0=col0,
                  row_len=row_len, row_max=row_max)
        F.m4v4_update_(p_ref, g, s_ref, cb, ratio, HYPER, **kw)
        assert c_kernels.m4v4_update_(p, g, s, cb, ratio, HYPER, **kw), "phase 2 did not apply"
        problem = parity.m4v4_disagreement(p, s, p_ref, s_ref, before)
        assert problem is None, f"step {step}: {problem}"


@pytest.mark.parametrize("isa", [0, 1, 2], ids=["portable", "avx2", "avx512"])
def test_row_statistics_kernels_agree(isa):
    """The portable, AVX2 and AVX-512 row-statistics kernels (capped by the CPU): the reference's
    row max bit for bit and its float64 row sums within 1e-12, row lengths with and without a
    vector tail, NaN rows included; and the same bits on every ISA."""
    cal = dataclasses.replace(c_kernels._calibrated(), isa=isa)
    gen = torch.Generator().manual_seed(isa)
    cb = _book(gen, 16)
    for cols in (7, 64, 203):
        g = _grad(gen, (9, cols), torch.bfloat16, zero_row=True)
        g[4, cols // 2] = float("nan")
        state = F.init_m4v4_state(g, (9, 2 * cols))
        state["mv_code"].copy_(torch.randint(0, 256, (9, cols), generator=gen, dtype=torch.uint8))
        state["m_row_scale"].copy_(torch.rand(9, generator=gen))
        row_sum, row_max = c_kernels.m4v4_row_stats(g, state, cb, HYPER.beta1, cal=cal)
        portable = c_kernels.m4v4_row_stats(g, state, cb, HYPER.beta1, cal=dataclasses.replace(cal, isa=0))
        assert_identical(row_sum.nan_to_num(), portable[0].nan_to_num(), f"{cols} columns: row sums, this ISA vs portable")
        assert_identical(row_max.nan_to_num(), portable[1].nan_to_num(), f"{cols} columns: row max, this ISA vs portable")
        want = F.row_square_sums(g)
        assert torch.isnan(row_sum[4]) and torch.isnan(want[4])
        row_sum[4] = want[4] = 0
        assert_close_f64(row_sum, want, f"{cols} columns: row sums")
        want = F.row_abs_max(F.m4v4_momentum(g, state, cb, HYPER.beta1))
        assert torch.isnan(row_max[4]) and torch.isnan(want[4])
        row_max[4] = want[4] = 0
        assert_identical(row_max, want, f"{cols} columns: row max")


def test_m4v4_column_offset_moves_the_rounding_noise():
    """The column offset is part of the hashed index: the same shard at another column rounds
    differently (so a kernel that ignored it could not match the reference above)."""
    gen = torch.Generator().manual_seed(3)
    cb, ratio = _book(gen, 16), ratio_table(_book(gen, 16))
    g = _grad(gen, (16, 64), torch.float32, zero_row=False)
    codes = []
    for col0 in (0, 64):
        p = torch.randn(16, 64, generator=torch.Generator().manual_seed(1))
        s = F.init_m4v4_state(p, (16, 128))
        v_row, parts = c_kernels.m4v4_partials(g, s, HYPER.beta2, row_sum=F.row_square_sums(g), row_len=128)
        assert c_kernels.m4v4_update_(p, g, s, cb, ratio, HYPER, global_rows=16, v_row=v_row, partials=parts,
                                         pidx=0, seed=0, col0=col0, row_len=128)
        codes.append(s["mv_code"].clone())
    assert not torch.equal(codes[0], codes[1])


@pytest.mark.parametrize("K", [16, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows,cols,threads", [(37, 33, 1), (300, 200, 2), (1, 500, 1)], ids=str)
def test_momentum_column_shard_matches_the_reference(rows, cols, threads, dtype, K):
    """GefenMuon's momentum on a column shard (one block per cut row): the block scales alone
    (state untouched), then the momentum re-quantised with the reduced scales given."""
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(K + rows)
    cb = _book(gen, K)
    s_ref = F.init_momentum_state(torch.zeros(rows, cols), (rows, 2 * cols), 2 * cols)  # period: the global row
    s = copy.deepcopy(s_ref)
    for step, beta in enumerate((0.95, 0.3, 0.95)):  # torch's lerp: both formulas
        g = _grad(gen, (rows, cols), dtype, zero_row=step == 1).float()
        saved = copy.deepcopy(s)
        scales = c_kernels.momentum_scales(s, g, beta, cb)
        assert scales is not None, "the block-scale kernel did not apply"
        for key in s:
            assert_identical(s[key], saved[key], f"step {step}: {key} touched by the scales alone")
        m = F.momentum_ema(s_ref, g, beta, cb)
        assert_identical(scales, block_scales(F.as_blocks(m, F._local_period(s_ref))), f"step {step}: scales")
        reduced = scales * 1.25 + 0.125 * step
        want = F.store_momentum_(s_ref, m, cb, reduced)
        got = c_kernels.momentum_(s, g, beta, cb, reduced)
        assert got is not None, "the momentum kernel did not apply"
        assert_identical(got, want, f"step {step}: momentum")
        for key, value in s_ref.items():
            assert_identical(s[key], value, f"step {step}: {key}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_histogram_with_given_scales_matches_the_reference(dtype):
    """The first step's histogram of a column shard's rows, normalised by their whole rows' max-abs
    (bigger than the shard's own), NaN scales and elements, and zero rows included."""
    gen = torch.Generator().manual_seed(11)
    rows = _grad(gen, (50, 700), dtype, zero_row=True)
    rows[3, 5] = float("nan")
    scale = F.row_abs_max(rows.float()) * (1 + torch.rand(50, generator=gen))
    scale[7], scale[2] = float("nan"), 0.0  # (row 2 is all zeros)
    for bins in (256, 4096):
        got = c_kernels.block_histograms([(rows, scale)], bins)
        assert got is not None
        assert torch.equal(got, histogram_normalised_blocks(rows.unsqueeze(1), bins, scale=scale))
        assert torch.equal(c_kernels.block_histograms([(rows, None)], bins), histogram_normalised_blocks(rows, bins))
